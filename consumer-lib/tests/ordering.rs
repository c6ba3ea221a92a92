//! Ordered consumption: sequenced events are applied per aggregate in
//! sequence order, whatever order, duplicates and failures they come with;
//! and the routing scheme that keeps an aggregate on one queue.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use common::{Env, Running, amqp_url, db_url, id, wait_until};
use futures_util::StreamExt as _;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use outbox::wire;
use outbox_consumer::{
    BatchHandler, BatchOutcome, Consumer, ConsumerConfig, Error, Event, Handler, OrderedTopology,
    Outcome, Sequencing, declare_ordered_topology,
};
use sqlx::{AssertSqlSafe, PgConnection};

/// One message to publish: its id, aggregate id and `x-aggregate-seq`
/// value (`None`: an unordered event), and an `x-retry-count` it already
/// carries (as if a handler had retried it before).
struct Msg {
    id: String,
    aggregate: String,
    seq: Option<AMQPValue>,
    retry_count: Option<i64>,
}

fn seq(aggregate: &str, n: i64) -> Msg {
    Msg {
        id: id(),
        aggregate: aggregate.to_owned(),
        seq: Some(AMQPValue::LongLongInt(n)),
        retry_count: None,
    }
}

fn unordered(aggregate: &str) -> Msg {
    Msg {
        id: id(),
        aggregate: aggregate.to_owned(),
        seq: None,
        retry_count: None,
    }
}

fn properties(m: &Msg) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(
        wire::HEADER_AGGREGATE_TYPE.into(),
        AMQPValue::LongString("order".into()),
    );
    if !m.aggregate.is_empty() {
        h.insert(
            wire::HEADER_AGGREGATE_ID.into(),
            AMQPValue::LongString(m.aggregate.as_str().into()),
        );
    }
    if let Some(s) = &m.seq {
        h.insert(wire::HEADER_AGGREGATE_SEQ.into(), s.clone());
    }
    if let Some(n) = m.retry_count {
        h.insert(wire::HEADER_RETRY_COUNT.into(), AMQPValue::LongLongInt(n));
    }
    BasicProperties::default()
        .with_message_id(m.id.as_str().into())
        .with_type("OrderChanged".into())
        .with_delivery_mode(2)
        .with_headers(h)
}

/// Publishes `msgs` in order to `exchange` with `routing_key` and waits for
/// every confirm.
async fn publish_to(env: &Env, exchange: &str, routing_key: &str, msgs: &[Msg]) {
    let mut confirms = Vec::new();
    for m in msgs {
        let c = env
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                br#"{}"#,
                properties(m),
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
}

/// Publishes straight to the test's queue (default exchange).
async fn publish(env: &Env, msgs: &[Msg]) {
    publish_to(env, "", &env.queue, msgs).await;
}

/// Records each applied event (aggregate, seq, retry and deferral
/// counts) in `applied`, in apply order. Fails with `Retry` as many times
/// as `fail` says for its (aggregate, seq) pairs, always with `Reject` for
/// those in `reject`.
struct Recorder {
    sql: String,
    fail: Mutex<HashMap<(String, i64), u32>>,
    reject: HashSet<(String, i64)>,
}

impl Recorder {
    /// Creates the `applied` table and a recorder writing to it.
    async fn new(env: &Env) -> Recorder {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {}.applied (n bigserial PRIMARY KEY, aggregate text NOT NULL, \
             seq bigint, retry_count int NOT NULL, deferral_count int NOT NULL, \
             event_id text NOT NULL)",
            env.schema
        )))
        .execute(&env.pool)
        .await
        .unwrap();
        Recorder::on(env)
    }

    /// Another recorder on the same table (another instance).
    fn on(env: &Env) -> Recorder {
        Recorder {
            sql: format!(
                "INSERT INTO {}.applied (aggregate, seq, retry_count, deferral_count, event_id) \
                 VALUES ($1, $2, $3, $4, $5)",
                env.schema
            ),
            fail: Mutex::default(),
            reject: HashSet::new(),
        }
    }

    fn fail_once(self, aggregate: &str, seq: i64) -> Self {
        self.fail_times(aggregate, seq, 1)
    }

    fn fail_times(self, aggregate: &str, seq: i64, times: u32) -> Self {
        self.fail
            .lock()
            .unwrap()
            .insert((aggregate.to_owned(), seq), times);
        self
    }
}

impl Handler for Recorder {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let aggregate = event.aggregate_id().unwrap_or_default().into_owned();
        let seq = event.aggregate_seq();
        // The effect is written first, so a failure must roll it back.
        if let Err(e) = sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(&aggregate)
            .bind(seq)
            .bind(event.retry_count() as i32)
            .bind(event.deferral_count() as i32)
            .bind(event.id())
            .execute(conn)
            .await
        {
            return Outcome::retry(e);
        }
        let key = (aggregate, seq.unwrap_or(0));
        if self.reject.contains(&key) {
            return Outcome::reject("refused by the test");
        }
        if let Some(left) = self.fail.lock().unwrap().get_mut(&key)
            && *left > 0
        {
            *left -= 1;
            return Outcome::retry("transient failure injected by the test");
        }
        Outcome::Ack
    }
}

/// The sequence numbers applied for `aggregate`, in apply order
/// (sequenced events only).
async fn applied(env: &Env, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT seq FROM {}.applied WHERE aggregate = $1 AND seq IS NOT NULL ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// Retry counts of the events applied for `aggregate`, in apply order.
async fn retry_counts(env: &Env, aggregate: &str) -> Vec<i32> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT retry_count FROM {}.applied WHERE aggregate = $1 ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// Deferral counts of the events applied for `aggregate`, in apply order.
async fn deferral_counts(env: &Env, aggregate: &str) -> Vec<i32> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT deferral_count FROM {}.applied WHERE aggregate = $1 ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

async fn last_seq(env: &Env, aggregate: &str) -> Option<i64> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT last_seq FROM {}.inbox_sequences WHERE consumer = 'svc' AND aggregate_id = $1",
        env.schema
    )))
    .bind(aggregate)
    .fetch_optional(&env.pool)
    .await
    .unwrap()
}

async fn wait_applied(env: &Env, aggregate: &str, n: usize) {
    wait_until(&format!("{n} events of {aggregate} applied"), || async {
        applied(env, aggregate).await.len() >= n
    })
    .await;
}

fn ordered(env: &Env, accept_first_seen: bool) -> ConsumerConfig {
    let mut c = env.config("svc");
    c.sequencing = Sequencing::BySequence { accept_first_seen };
    c.retry_delay = Duration::from_millis(20);
    c.max_retry_delay = Duration::from_millis(200);
    c
}

fn reason(m: &lapin::message::BasicGetMessage) -> String {
    match m
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(wire::HEADER_DEAD_LETTER_REASON))
    {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("no dead-letter reason: {other:?}"),
    }
}

/// Dead letters of the test queue by message id, waiting for `n`.
async fn dead_letters(env: &Env, n: usize) -> BTreeMap<String, String> {
    env.take(&format!("{}.dlq", env.queue), n)
        .await
        .iter()
        .map(|m| {
            let id = m.properties.message_id().as_ref().unwrap().to_string();
            (id, reason(m))
        })
        .collect()
}

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

/// A second connection for assertions that close their channel or
/// connection on failure.
async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap()
}

/// Redeclaring `queue` with the quorum arguments the topology gives it,
/// but without `x-single-active-consumer`, is refused: the queue has it.
async fn assert_single_active(queue: &str, quorum: bool) {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    if quorum {
        let text = |s: &str| lapin::types::AMQPValue::LongString(s.into());
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert(
            "x-delivery-limit".into(),
            lapin::types::AMQPValue::LongLongInt(outbox_consumer::DEFAULT_DELIVERY_LIMIT.into()),
        );
        args.insert("x-dead-letter-exchange".into(), text(""));
        args.insert(
            "x-dead-letter-routing-key".into(),
            text(&format!("{queue}.dlq")),
        );
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
    }
    let err = ch
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("x-single-active-consumer"),
        "{queue}: {err}"
    );
    let _ = conn.close(200, "bye".into()).await;
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_keep_each_aggregate_on_one_queue_in_publish_order() {
    let mut env = Env::new().await;
    let source = unique("t_c_ox");
    let name = unique("t_c_o");
    let mut topology = OrderedTopology::new(&name, &source, "order.#", 4);
    // Classic: the test reads the partitions with basic.get, which quorum
    // queues with single active consumer refuse.
    topology.queue_type = outbox_consumer::QueueType::Classic;
    let queues = declare_ordered_topology(&env.amqp, &topology)
        .await
        .unwrap();
    for q in &queues {
        env.delete_on_teardown(q);
    }
    env.delete_exchange_on_teardown(&name);
    env.delete_exchange_on_teardown(&source);
    assert_eq!(
        queues,
        (0..4).map(|i| format!("{name}.{i}")).collect::<Vec<_>>()
    );
    // Idempotent.
    assert_eq!(
        declare_ordered_topology(&env.amqp, &topology)
            .await
            .unwrap(),
        queues
    );

    // 400 events over 40 aggregates; the body carries the publish number.
    let mut confirms = Vec::new();
    for n in 0..400u32 {
        let m = unordered(&format!("agg-{}", n % 40));
        let body = format!(r#"{{"n":{n}}}"#);
        confirms.push(
            env.channel
                .basic_publish(
                    source.as_str().into(),
                    "order.OrderChanged".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.as_bytes(),
                    properties(&m),
                )
                .await
                .unwrap(),
        );
    }
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    // Drain: per queue, (aggregate, publish number) in queue order.
    let mut drained: Vec<Vec<(String, u64)>> = vec![Vec::new(); queues.len()];
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while drained.iter().map(Vec::len).sum::<usize>() < 400 {
        let mut got = false;
        for (q, into) in queues.iter().zip(&mut drained) {
            if let Some(m) = env
                .channel
                .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                let aggregate = match m
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get(wire::HEADER_AGGREGATE_ID))
                {
                    Some(AMQPValue::LongString(s)) => s.to_string(),
                    other => panic!("{other:?}"),
                };
                let body: serde_json::Value = serde_json::from_slice(&m.data).unwrap();
                into.push((aggregate, body["n"].as_u64().unwrap()));
                got = true;
            }
        }
        if !got {
            assert!(tokio::time::Instant::now() < deadline, "messages missing");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut home: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, msgs) in drained.iter().enumerate() {
        let mut last: BTreeMap<&str, u64> = BTreeMap::new();
        for (aggregate, n) in msgs {
            let q = *home.entry(aggregate).or_insert(i);
            assert_eq!(q, i, "{aggregate} is on queues {q} and {i}");
            if let Some(prev) = last.insert(aggregate, *n) {
                assert!(prev < *n, "{aggregate}: {n} after {prev} on queue {i}");
            }
        }
    }
    assert_eq!(home.len(), 40);
    let used = drained.iter().filter(|m| !m.is_empty()).count();
    assert!(
        used >= 2,
        "the hash spreads aggregates: {used} queue(s) used"
    );

    // Single active consumer: every queue has it, and of two consumers
    // on a queue only the first receives.
    for q in &queues {
        assert_single_active(q, false).await;
    }
    let conn = connect().await;
    let (first, second) = (
        conn.create_channel().await.unwrap(),
        conn.create_channel().await.unwrap(),
    );
    let mut streams = Vec::new();
    for (ch, tag) in [(&first, "first"), (&second, "second")] {
        ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
        streams.push(
            ch.basic_consume(
                queues[1].as_str().into(),
                tag.into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap(),
        );
    }
    let to_second: Vec<Msg> = (0..20).map(|_| unordered("direct")).collect();
    publish_to(&env, "", &queues[1], &to_second).await;
    let mut received = 0;
    while received < 20 {
        // Without single active consumer, half would go to the second.
        tokio::time::timeout(common::DEADLINE, streams[0].next())
            .await
            .expect("the first consumer received everything")
            .unwrap()
            .unwrap();
        received += 1;
    }
    let _ = conn.close(200, "bye".into()).await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_partition_is_one_single_active_queue_and_consumers_apply_in_order() {
    let mut env = Env::new().await;
    let source = unique("t_c_ox");
    let name = unique("t_c_o");
    let one = OrderedTopology::new(&name, &source, "order.#", 1);
    let queues = declare_ordered_topology(&env.amqp, &one).await.unwrap();
    assert_eq!(queues, std::slice::from_ref(&name));
    env.delete_on_teardown(&name);
    env.delete_exchange_on_teardown(&source);
    assert_single_active(&name, true).await;
    // Each aggregate's events out of order: 2 before 1.
    let msgs: Vec<Msg> = (0..5)
        .flat_map(|a| [seq(&format!("g{a}"), 2), seq(&format!("g{a}"), 1)])
        .collect();
    publish_to(&env, &source, "order.OrderChanged", &msgs).await;
    Recorder::new(&env).await;
    let mut cfg = ordered(&env, false);
    cfg.queue = name.clone();
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Recorder::on(&env)).unwrap());
    wait_until("every event applied", || async {
        env.count("{s}.applied").await >= 10
    })
    .await;
    for a in 0..5 {
        assert_eq!(applied(&env, &format!("g{a}")).await, [1, 2]);
    }
    c.stop().await;
    env.teardown().await;
}
