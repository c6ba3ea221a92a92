//! Sequenced events applied per aggregate in sequence order, whatever
//! order, duplicates, gaps and failures they come with.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_waits_for_the_missing_event() {
    let env = Env::new().await;
    publish(&env, &[seq("a", 1), seq("a", 3), seq("a", 2)]).await;
    let h = Recorder::new(&env).await;
    let c = Running::start(Consumer::new(ordered(&env, false), env.pool.clone(), h).unwrap());
    wait_applied(&env, "a", 3).await;
    assert_eq!(applied(&env, "a").await, [1, 2, 3]);
    // 3 came before 2: it went once through the retry queue, as a
    // deferral, not a handler retry.
    assert_eq!(retry_counts(&env, "a").await, [0, 0, 0]);
    assert_eq!(deferral_counts(&env, "a").await, [0, 0, 1]);
    assert_eq!(c.consumer.stats().retried, 1);
    assert_eq!(last_seq(&env, "a").await, Some(3));
    assert_eq!(env.count("{s}.inbox_processed").await, 3);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_and_duplicate_copies_are_acked_without_effect() {
    let env = Env::new().await;
    let (one, two, three) = (seq("a", 1), seq("a", 2), seq("a", 3));
    // Copies of 2 and 1 under other ids (past the inbox: only the sequence
    // number tells) arrive after the originals, one of them after 2.
    let copies = [seq("a", 2), seq("a", 1)];
    let copy_ids: Vec<String> = copies.iter().map(|m| m.id.clone()).collect();
    publish(&env, &[one, two]).await;
    publish(&env, &copies).await;
    publish(&env, &[three]).await;
    let h = Recorder::new(&env).await;
    let c = Running::start(Consumer::new(ordered(&env, false), env.pool.clone(), h).unwrap());
    wait_until("all settled", || async { c.consumer.stats().acked() == 5 }).await;
    assert_eq!(applied(&env, "a").await, [1, 2, 3]);
    let s = c.consumer.stats();
    assert_eq!((s.processed, s.stale, s.retried), (3, 2, 0));
    // Stale events were not applied: they keep no inbox row.
    for copy in &copy_ids {
        let sql = format!("{{s}}.inbox_processed WHERE event_id = '{copy}'");
        assert_eq!(env.count(&sql).await, 0);
    }
    assert_eq!(env.count("{s}.inbox_processed").await, 3);
    // A zombie relay republishes 1 and 2 under their own ids: duplicates.
    let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT event_id FROM {}.applied ORDER BY n LIMIT 2",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let republished: Vec<Msg> = ids
        .iter()
        .zip([1, 2])
        .map(|(id, n)| Msg {
            id: id.clone(),
            ..seq("a", n)
        })
        .collect();
    publish(&env, &republished).await;
    wait_until("the duplicates settled", || async {
        c.consumer.stats().duplicates == 2
    })
    .await;
    assert_eq!(applied(&env, "a").await, [1, 2, 3]);
    assert_eq!(last_seq(&env, "a").await, Some(3));
    c.stop().await;
    env.teardown().await;
}

/// A deterministic id enqueued again after the relay deleted its first
/// copy comes back with the next number of its aggregate. The consumer
/// recognises the id, runs nothing, and moves the aggregate past that
/// number: the next event is applied at once, not after the deferral
/// budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_comes_back_with_a_new_number_is_passed_over() {
    let env = Env::new().await;
    let h = Recorder::new(&env).await;
    let mut config = ordered(&env, false);
    config.max_deferrals = 1_000;
    let c = Running::start(Consumer::new(config, env.pool.clone(), h).unwrap());
    let first = seq("a", 1);
    let again = Msg {
        id: first.id.clone(),
        ..seq("a", 2)
    };
    publish(&env, &[first]).await;
    wait_applied(&env, "a", 1).await;
    publish(&env, &[again, seq("a", 3)]).await;
    wait_applied(&env, "a", 2).await;
    assert_eq!(applied(&env, "a").await, [1, 3]);
    assert_eq!(last_seq(&env, "a").await, Some(3));
    let s = c.consumer.stats();
    assert_eq!((s.processed, s.duplicates), (2, 1));
    // The copy arriving ahead of its number waits for it, then is passed
    // over too.
    let late = seq("a", 4);
    let copy = Msg {
        id: late.id.clone(),
        ..seq("a", 6)
    };
    publish(&env, &[copy, late, seq("a", 5), seq("a", 7)]).await;
    wait_applied(&env, "a", 5).await;
    assert_eq!(applied(&env, "a").await, [1, 3, 4, 5, 7]);
    assert_eq!(last_seq(&env, "a").await, Some(7));
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_event_holds_back_the_rest_of_its_aggregate() {
    let env = Env::new().await;
    let msgs = [
        seq("a", 1),
        seq("a", 2),
        seq("b", 1),
        seq("a", 3),
        seq("a", 4),
        seq("b", 2),
    ];
    publish(&env, &msgs).await;
    let h = Recorder::new(&env).await.fail_once("a", 2);
    let mut cfg = ordered(&env, false);
    // All six in the first batch.
    (cfg.batch_size, cfg.prefetch) = (6, 6);
    cfg.batch_max_wait = Duration::from_millis(500);
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    wait_applied(&env, "a", 4).await;
    assert_eq!(applied(&env, "a").await, [1, 2, 3, 4]);
    // 2 failed; 3 and 4 were held back (deferred) rather than applied out
    // of order.
    assert_eq!(retry_counts(&env, "a").await, [0, 1, 0, 0]);
    assert_eq!(deferral_counts(&env, "a").await, [0, 0, 1, 1]);
    assert_eq!(c.consumer.stats().retried, 3);
    // The other aggregate was not held back.
    assert_eq!(applied(&env, "b").await, [1, 2]);
    assert_eq!(retry_counts(&env, "b").await, [0, 0]);
    assert_eq!(last_seq(&env, "a").await, Some(4));
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_and_gapped_events_end_in_the_dlq_with_their_reason() {
    let env = Env::new().await;
    let msgs = [seq("a", 1), seq("a", 2), seq("a", 3), seq("c", 2)];
    let ids: Vec<String> = msgs.iter().map(|m| m.id.clone()).collect();
    publish(&env, &msgs).await;
    let mut h = Recorder::new(&env).await;
    h.reject.insert(("a".to_owned(), 2));
    let mut cfg = ordered(&env, false);
    cfg.max_deferrals = 0;
    (cfg.batch_size, cfg.prefetch) = (4, 4);
    cfg.batch_max_wait = Duration::from_millis(500);
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    let dlq = dead_letters(&env, 3).await;
    assert_eq!(dlq[&ids[1]], "refused by the test");
    assert_eq!(
        dlq[&ids[2]],
        "sequence gap never closed after 0 deferrals: expected 2, got 3 \
         (held back behind a failed earlier event of this aggregate)"
    );
    assert_eq!(
        dlq[&ids[3]],
        "sequence gap never closed after 0 deferrals: expected 1, got 2"
    );
    assert_eq!(applied(&env, "a").await, [1]);
    assert!(applied(&env, "c").await.is_empty());
    assert_eq!(last_seq(&env, "a").await, Some(1));
    assert_eq!(
        env.count("{s}.inbox_processed").await,
        1,
        "only the applied event"
    );
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_accept_first_seen_every_aggregate_starts_at_1() {
    let env = Env::new().await;
    let late = seq("a", 5);
    let late_id = late.id.clone();
    publish(&env, &[late, seq("b", 1)]).await;
    let h = Recorder::new(&env).await;
    let mut cfg = ordered(&env, false);
    cfg.max_deferrals = 1;
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    let dlq = dead_letters(&env, 1).await;
    assert_eq!(
        dlq[&late_id],
        "sequence gap never closed after 1 deferrals: expected 1, got 5"
    );
    assert!(applied(&env, "a").await.is_empty());
    assert_eq!(applied(&env, "b").await, [1]);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_first_seen_starts_where_the_consumer_joins() {
    let env = Env::new().await;
    // "old" was seen before (last applied 2): it does not start over.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}.inbox_sequences (consumer, aggregate_type, aggregate_id, last_seq) \
         VALUES ('svc', 'order', 'old', 2)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .unwrap();
    let old = seq("old", 5);
    let old_id = old.id.clone();
    // The first event of "late" fails once: its retry must still be
    // expected, and 6 must wait for it.
    publish(
        &env,
        &[
            seq("new", 5),
            seq("new", 6),
            old,
            seq("late", 9),
            seq("late", 10),
        ],
    )
    .await;
    let h = Recorder::new(&env).await.fail_once("late", 9);
    let mut cfg = ordered(&env, true);
    (cfg.max_retries, cfg.max_deferrals) = (1, 1);
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    wait_applied(&env, "late", 2).await;
    assert_eq!(applied(&env, "new").await, [5, 6]);
    assert_eq!(applied(&env, "late").await, [9, 10]);
    let dlq = dead_letters(&env, 1).await;
    assert_eq!(
        dlq[&old_id],
        "sequence gap never closed after 1 deferrals: expected 3, got 5"
    );
    // Once seen, an aggregate is ordered like any other.
    publish(&env, &[seq("new", 4)]).await;
    wait_until("the stale event settled", || async {
        c.consumer.stats().stale == 1
    })
    .await;
    assert_eq!(applied(&env, "new").await, [5, 6]);
    assert_eq!(last_seq(&env, "new").await, Some(6));
    assert_eq!(last_seq(&env, "old").await, Some(2));
    c.stop().await;
    env.teardown().await;
}

/// The review's scenario: an event fails transiently as often as
/// `max_retries` allows while its successors wait in the retry queue for
/// longer than that. Deferrals have their own budget: every event applies
/// in order, nothing is dead-lettered, and the aggregate is not wedged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferrals_do_not_spend_the_handler_retry_budget() {
    let env = Env::new().await;
    // 2 and 3 arrive first and gap until 1 comes.
    publish(&env, &[seq("a", 2), seq("a", 3)]).await;
    let h = Recorder::new(&env).await.fail_times("a", 1, 2);
    let mut cfg = ordered(&env, false);
    cfg.max_retries = 2;
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    // Both deferred three times, more than max_retries.
    wait_until("2 and 3 deferred three times each", || async {
        let s = c.consumer.stats();
        s.retried >= 6 || s.rejected > 0
    })
    .await;
    assert_eq!(
        c.consumer.stats().rejected,
        0,
        "deferred events dead-lettered"
    );
    // 1 now fails twice (all its retries) and applies on the third try;
    // 2 and 3 keep being deferred meanwhile.
    publish(&env, &[seq("a", 1)]).await;
    wait_applied(&env, "a", 3).await;
    assert_eq!(applied(&env, "a").await, [1, 2, 3]);
    assert_eq!(retry_counts(&env, "a").await, [2, 0, 0]);
    let deferrals = deferral_counts(&env, "a").await;
    assert_eq!(deferrals[0], 0);
    assert!(
        deferrals[1..].iter().all(|&n| n > 2),
        "deferred more than max_retries: {deferrals:?}"
    );
    assert_eq!(last_seq(&env, "a").await, Some(3));
    // Counted once the batch is settled, just after its commit.
    wait_until("all three counted", || async {
        c.consumer.stats().processed == 3
    })
    .await;
    assert_eq!(c.consumer.stats().rejected, 0);
    let dlq = format!("{}.dlq", env.queue);
    let none = env
        .channel
        .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(none.is_none(), "nothing in the DLQ");
    c.stop().await;
    env.teardown().await;
}

/// A gap that never closes is dead-lettered after `max_deferrals`, however
/// low `max_retries` is, with the deferral count on the copy and the
/// handler retry count it came with unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_gap_is_dead_lettered_after_max_deferrals() {
    let env = Env::new().await;
    let orphan = Msg {
        retry_count: Some(1),
        ..seq("g", 2)
    };
    let orphan_id = orphan.id.clone();
    publish(&env, &[orphan]).await;
    let h = Recorder::new(&env).await;
    let mut cfg = ordered(&env, false);
    (cfg.max_retries, cfg.max_deferrals) = (0, 3);
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    let copy = env.take(&format!("{}.dlq", env.queue), 1).await.remove(0);
    assert_eq!(
        copy.properties.message_id().as_ref().unwrap().as_str(),
        orphan_id
    );
    assert_eq!(
        reason(&copy),
        "sequence gap never closed after 3 deferrals: expected 1, got 2"
    );
    let header = |name: &str| {
        copy.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
            .cloned()
    };
    assert_eq!(
        header(outbox_consumer::HEADER_DEFERRAL_COUNT),
        Some(AMQPValue::LongLongInt(3))
    );
    assert_eq!(
        header(wire::HEADER_RETRY_COUNT),
        Some(AMQPValue::LongLongInt(1))
    );
    // Counted once the batch is settled, just after the copy is queued.
    wait_until("the dead letter counted", || async {
        c.consumer.stats().rejected == 1
    })
    .await;
    assert_eq!(c.consumer.stats().retried, 3);
    assert!(applied(&env, "g").await.is_empty());
    assert_eq!(last_seq(&env, "g").await, Some(0));
    c.stop().await;
    env.teardown().await;
}

/// With `accept_first_seen`, a new aggregate starts below the lowest fresh
/// event of its first batch, not its first in delivery order: 7 came back
/// from the retry queue behind 8 and is applied, not dropped as stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_first_seen_starts_below_the_lowest_event_of_the_batch() {
    let env = Env::new().await;
    publish(&env, &[seq("n", 8), seq("n", 7)]).await;
    let h = Recorder::new(&env).await;
    let mut cfg = ordered(&env, true);
    (cfg.batch_size, cfg.prefetch) = (2, 2);
    cfg.batch_max_wait = Duration::from_millis(500);
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), h).unwrap());
    wait_until("both settled for good", || async {
        let s = c.consumer.stats();
        s.processed + s.stale >= 2
    })
    .await;
    assert_eq!(applied(&env, "n").await, [7, 8]);
    assert_eq!(c.consumer.stats().stale, 0);
    assert_eq!(last_seq(&env, "n").await, Some(8));
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_sequence_numbers_are_poison() {
    let env = Env::new().await;
    let bad = [
        Msg {
            seq: Some(AMQPValue::LongString("3".into())),
            ..seq("a", 0)
        },
        seq("a", 0),
        seq("a", -3),
        Msg {
            aggregate: String::new(), // no x-aggregate-id
            ..seq("a", 1)
        },
    ];
    let ids: Vec<String> = bad.iter().map(|m| m.id.clone()).collect();
    publish(&env, &bad).await;
    publish(&env, &[seq("a", 1)]).await;
    let h = Recorder::new(&env).await;
    let c = Running::start(Consumer::new(ordered(&env, false), env.pool.clone(), h).unwrap());
    let dlq = dead_letters(&env, 4).await;
    for id in &ids[..3] {
        assert!(
            dlq[id].starts_with(
                "poison message: header x-aggregate-seq must be an integer of at least 1"
            ),
            "{}",
            dlq[id]
        );
    }
    assert!(
        dlq[&ids[3]].contains("needs a non-empty header x-aggregate-id"),
        "{}",
        dlq[&ids[3]]
    );
    wait_applied(&env, "a", 1).await;
    assert_eq!(applied(&env, "a").await, [1]);
    assert_eq!(c.consumer.stats().poison, 4);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unordered_events_are_not_affected() {
    let env = Env::new().await;
    // Same aggregate: the unordered events do not wait for the gap.
    publish(
        &env,
        &[unordered("a"), seq("a", 2), unordered("a"), seq("a", 1)],
    )
    .await;
    let h = Recorder::new(&env).await;
    let c = Running::start(Consumer::new(ordered(&env, false), env.pool.clone(), h).unwrap());
    wait_until("all applied", || async {
        env.count("{s}.applied").await == 4
    })
    .await;
    let rows: Vec<(Option<i64>, i32, i32)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT seq, retry_count, deferral_count FROM {}.applied ORDER BY n",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .unwrap();
    // Only 2 waited (one deferral) for the gap.
    assert_eq!(
        rows,
        [(None, 0, 0), (None, 0, 0), (Some(1), 0, 0), (Some(2), 0, 1)],
        "unordered events applied at once, in delivery order"
    );
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ordering_off_the_sequence_header_is_ignored() {
    let env = Env::new().await;
    let not_a_number = Msg {
        seq: Some(AMQPValue::LongString("x".into())),
        ..seq("a", 0)
    };
    publish(&env, &[seq("a", 2), seq("a", 1), not_a_number]).await;
    let h = Recorder::new(&env).await;
    let c = Running::start(Consumer::new(env.config("svc"), env.pool.clone(), h).unwrap());
    wait_until("all applied", || async {
        env.count("{s}.applied").await == 3
    })
    .await;
    // In delivery order, the malformed header ignored.
    assert_eq!(applied(&env, "a").await, [2, 1]);
    let s = c.consumer.stats();
    assert_eq!((s.processed, s.retried, s.poison), (3, 0, 0));
    assert_eq!(env.count("{s}.inbox_sequences").await, 0);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_with_a_batch_handler_is_refused() {
    struct Batch;
    impl BatchHandler for Batch {
        async fn handle_batch(&self, _: &mut PgConnection, _: &[Event]) -> BatchOutcome {
            BatchOutcome::All(Outcome::Ack)
        }
    }
    let pool = sqlx::PgPool::connect_lazy(&db_url()).unwrap();
    let mut cfg = ConsumerConfig::new(amqp_url(), "q", "svc");
    cfg.sequencing = Sequencing::by_sequence();
    let refused = Consumer::with_batch_handler(cfg.clone(), pool.clone(), Batch);
    assert!(
        matches!(&refused, Err(Error::Config(m)) if m.contains("per-event Handler")),
        "{refused:?}"
    );
    let mut off = cfg;
    off.sequencing = Sequencing::Off;
    assert!(Consumer::with_batch_handler(off, pool, Batch).is_ok());
}

/// Two instances on one plain queue (no single active consumer): the
/// sequence lock alone keeps every aggregate in order, and of two copies
/// of an event under different ids (past the inbox) exactly one applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_queue_keep_every_aggregate_in_order() {
    let env = Env::new().await;
    let (aggregates, per) = (8, 15);
    let msgs: Vec<Msg> = (1..=per)
        .flat_map(|n| {
            (0..aggregates).flat_map(move |a| [seq(&format!("g{a}"), n), seq(&format!("g{a}"), n)])
        })
        .collect();
    publish(&env, &msgs).await;
    Recorder::new(&env).await;
    let start = || {
        let mut cfg = ordered(&env, false);
        (cfg.batch_size, cfg.prefetch) = (4, 4);
        cfg.retry_delay = Duration::from_millis(10);
        cfg.max_retry_delay = Duration::from_millis(100);
        cfg.max_deferrals = 1000;
        Running::start(Consumer::new(cfg, env.pool.clone(), Recorder::on(&env)).unwrap())
    };
    let (c1, c2) = (start(), start());
    let total = aggregates * per;
    // Every event: one copy applied, the other stale.
    let stats = || {
        let (a, b) = (c1.consumer.stats(), c2.consumer.stats());
        (
            a.processed + b.processed,
            a.stale + b.stale,
            a.rejected + b.rejected,
        )
    };
    wait_until("every copy settled", || async {
        let (processed, stale, _) = stats();
        processed + stale >= 2 * total as u64
    })
    .await;
    assert_eq!(stats(), (total as u64, total as u64, 0));
    assert_eq!(env.count("{s}.applied").await, total);
    for a in 0..aggregates {
        assert_eq!(
            applied(&env, &format!("g{a}")).await,
            (1..=per).collect::<Vec<_>>()
        );
    }
    c1.stop().await;
    c2.stop().await;
    env.teardown().await;
}
