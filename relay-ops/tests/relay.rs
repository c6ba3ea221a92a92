//! The relay engine in-process against the real services.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDb, TestRelay, amqp_url, wait_until};
use lapin::types::{AMQPValue, FieldTable};
use outbox::{Capture, NewEvent};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn rolled_back_events_are_never_published_and_committed_ones_carry_the_contract() {
    let db = TestDb::producer("relay_contract").await;
    let broker = TestBroker::new("contract", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ob = db.outbox(Capture::Table).await;
    // The relay runs while the transaction is open and uncommitted: a
    // relay that could see (or lock and publish) uncommitted rows fails.
    let relay = TestRelay::new(&db, &broker).start().await;
    let mut tx = db.pool.begin().await.unwrap();
    let rolled_back = ob
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-0", "OrderPlaced", &json!({"n": 0})).unwrap(),
        )
        .await
        .unwrap();
    // Witnesses committed after the uncommitted insert, the second after a
    // wake-up: once they are published, the relay has claimed (woken and
    // by its 200 ms poll) with the rolled-back event's row in the table.
    for n in [1, 2] {
        let mut w = db.pool.begin().await.unwrap();
        let witness = ob
            .enqueue(
                &mut *w,
                NewEvent::new("order", "o-w", "OrderPlaced", &json!({"n": -n})).unwrap(),
            )
            .await
            .unwrap();
        ob.commit(w).await.unwrap();
        relay.wake();
        wait_until(DEADLINE, "a witness", || async {
            collector.has(&witness.to_string())
        })
        .await;
    }
    tx.rollback().await.unwrap();

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut tx = db.pool.begin().await.unwrap();
    let id = ob
        .enqueue(
            &mut *tx,
            NewEvent::new(
                "order",
                "o-1",
                "OrderPlaced",
                &json!({"sku": "A-1", "qty": 2}),
            )
            .unwrap()
            .header("traceparent", traceparent)
            .header("tenant", "acme"),
        )
        .await
        .unwrap();
    let created_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT created_at FROM \"{}\".outbox WHERE id = $1",
            db.schema
        )))
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    ob.commit(tx).await.unwrap();

    wait_until(DEADLINE, "the committed event", || async {
        collector.has(&id.to_string())
    })
    .await;
    wait_until(DEADLINE, "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;

    {
        let got = collector.received.lock().unwrap();
        assert!(
            !got.counts.contains_key(&rolled_back.to_string()),
            "a rolled-back event was published"
        );
        assert_eq!(got.counts.len(), 3, "the witnesses and the committed event");
        assert_eq!(got.duplicates(), 0, "no fault: no copy");
        let d = &got.first[&id.to_string()];
        e2e::assert_contract(
            d,
            &id.to_string(),
            "OrderPlaced",
            ("order", "o-1"),
            created_at.timestamp(),
            &[("traceparent", traceparent), ("tenant", "acme")],
            "order.OrderPlaced",
        );
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body, json!({"sku": "A-1", "qty": 2}));
    }
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn unroutable_event_is_retried_with_backoff_dead_lettered_and_replayable() {
    let db = TestDb::producer("relay_noroute").await;
    let broker = TestBroker::new("noroute", FieldTable::default()).await;
    let ob = db.outbox(Capture::Table).await;
    // Routed to the default exchange "" with a key no queue has: returned.
    let mut tx = db.pool.begin().await.unwrap();
    let id = ob
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-1", "OrderPlaced", &json!({}))
                .unwrap()
                .exchange("")
                .routing_key(format!("{}.missing", broker.queue)),
        )
        .await
        .unwrap();
    ob.commit(tx).await.unwrap();

    let relay = TestRelay::new(&db, &broker)
        .with(|c| c.max_attempts = 4)
        .build()
        .await;
    let running = TestRelay::spawn(&relay);
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    // While retrying, it stays in the outbox and status says why.
    wait_until(DEADLINE, "a recorded retry", || async {
        let s = outbox_relay_ops::admin::status(&db.pool, &schema)
            .await
            .unwrap();
        s.retrying == 1
            && s.failing[0]
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("NO_ROUTE"))
    })
    .await;
    wait_until(DEADLINE, "the dead letter", || async {
        db.count("outbox_dead_letters").await == 1
    })
    .await;
    running.stop().await;
    assert_eq!(db.count("outbox").await, 0);

    let dl = outbox_relay_ops::admin::list_dead_letters(&db.pool, &schema, 10)
        .await
        .unwrap();
    assert_eq!(dl[0].id, id);
    assert_eq!(dl[0].attempts, 4);
    assert!(
        dl[0].last_error.contains("NO_ROUTE"),
        "{}",
        dl[0].last_error
    );
    // The history shows backoff between attempts, not a hot loop: each gap
    // is at least half the capped exponential delay.
    let history: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT error_history FROM \"{}\".outbox_dead_letters WHERE id = $1",
        db.schema
    )))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let times: Vec<chrono::DateTime<chrono::Utc>> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["at"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(times.len(), 4);
    for (n, w) in times.windows(2).enumerate() {
        let min = (50u64 << n).min(400) / 2;
        let gap = (w[1] - w[0]).num_milliseconds();
        assert!(
            gap >= min as i64,
            "attempt {} came {gap} ms after the previous, less than {min} ms",
            n + 2
        );
    }

    // Replay, now with a route: delivered.
    let collector = Collector::start(&broker.queue);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox_dead_letters SET exchange = NULL, routing_key = NULL",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let replayed = outbox_relay_ops::admin::replay_dead_letters(
        &db.pool,
        &schema,
        &outbox_relay_ops::admin::Selection::Ids(vec![id]),
        Duration::from_secs(3600),
        None,
    )
    .await
    .unwrap();
    assert_eq!(replayed.replayed, 1);
    assert!(replayed.older_than_retention.is_empty());
    assert!(replayed.conflicts.is_empty());
    let running = TestRelay::spawn(&relay);
    wait_until(DEADLINE, "the replayed event", || async {
        collector.has(&id.to_string())
    })
    .await;
    running.stop().await;
    assert_eq!(db.count("outbox_dead_letters").await, 0);
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn broker_nacks_are_retried_with_backoff_without_a_hot_loop() {
    let db = TestDb::producer("relay_nack").await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let broker = TestBroker::new("nack", args).await;
    let ids = db.produce(3, 3, Duration::ZERO).await;
    let relay = TestRelay::new(&db, &broker)
        .with(|c| c.max_attempts = 100)
        .start()
        .await;
    wait_until(DEADLINE, "three nacked attempts each", || async {
        let min: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT min(attempts) FROM \"{}\".outbox",
            db.schema
        )))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        min >= Some(3)
    })
    .await;
    relay.stop().await;
    let rows: Vec<(i32, String, serde_json::Value)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT attempts, last_error, error_history FROM \"{}\".outbox",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), ids.len(), "nacked events stay in the outbox");
    for (attempts, last_error, history) in rows {
        assert!(last_error.contains("nacked"), "{last_error}");
        let times: Vec<chrono::DateTime<chrono::Utc>> = history
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["at"].as_str().unwrap().parse().unwrap())
            .collect();
        assert_eq!(times.len(), attempts as usize);
        for (n, w) in times.windows(2).enumerate() {
            let min = (50i64 << n).min(400) / 2;
            assert!(
                (w[1] - w[0]).num_milliseconds() >= min,
                "retry {} too soon: hot loop",
                n + 2
            );
        }
    }
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn three_relays_deliver_every_one_of_20000_events() {
    let db = TestDb::producer("relay_three").await;
    let broker = TestBroker::new("three", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let mut relays = Vec::new();
    for _ in 0..3 {
        let relay = TestRelay::new(&db, &broker)
            .with(|c| c.batch_size = 200)
            .own_pool(&format!("relay-{}", db.schema), 4)
            .start()
            .await;
        relays.push(relay);
    }
    // Produce while the relays run.
    let ids = db.produce(20_000, 250, Duration::ZERO).await;
    wait_until(Duration::from_secs(180), "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    for relay in relays {
        relay.stop().await;
    }
    collector.drain(Duration::from_secs(120)).await;
    {
        let got = collector.received.lock().unwrap();
        let expected: HashSet<&String> = ids.iter().collect();
        let seen: HashSet<&String> = got.counts.keys().collect();
        assert_eq!(seen, expected, "every event delivered, nothing else");
        // SKIP LOCKED: no event is claimed by two relays.
        assert_eq!(got.duplicates(), 0, "no fault: no copy");
        println!(
            "three relays: {} events, {} duplicates on the wire",
            ids.len(),
            got.duplicates()
        );
    }
    assert_eq!(db.count("outbox").await, 0);
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn terminated_database_backends_mid_batch_lose_nothing() {
    let db = TestDb::producer("relay_pgkill").await;
    let broker = TestBroker::new("pgkill", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(5_000, 500, Duration::ZERO).await;
    let app = format!("relay-{}", db.schema);
    let relay = TestRelay::new(&db, &broker)
        .with(|c| c.batch_size = 100)
        .own_pool(&app, 4)
        .start()
        .await;
    let mut kills = 0;
    while collector.distinct() < ids.len() / 2 && kills < 50 {
        // Only busy backends (in a statement or a transaction): a
        // termination that lands on work in flight.
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE application_name = $1 AND state <> 'idle'",
        )
        .bind(&app)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        kills += n;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(kills > 0, "no busy backend was terminated");
    wait_until(
        Duration::from_secs(120),
        "the outbox to empty after the terminations",
        || async { db.count("outbox").await == 0 },
    )
    .await;
    relay.stop().await;
    collector.drain(Duration::from_secs(120)).await;
    {
        let got = collector.received.lock().unwrap();
        let seen: HashSet<&String> = got.counts.keys().collect();
        assert_eq!(seen, ids.iter().collect(), "nothing lost");
        println!(
            "busy pg backends terminated: {kills}, events {}, duplicates {}",
            ids.len(),
            got.duplicates()
        );
    }
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn an_unpublishable_event_is_dead_lettered_and_does_not_stall_its_batch() {
    let db = TestDb::producer("relay_poison").await;
    let broker = TestBroker::new("poison", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    // What a producer in another language could insert into a table from
    // before migration 4 (whose CHECK now refuses it): a 300-byte event
    // type cannot travel as an AMQP short string.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE \"{}\".outbox DROP CONSTRAINT outbox_names_publishable",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let poison: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'o-1', repeat('E', 300), '{{}}') RETURNING id",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let ids = db.produce(50, 50, Duration::ZERO).await;
    let relay = TestRelay::new(&db, &broker).start().await;
    wait_until(DEADLINE, "the good events", || async {
        collector.distinct() >= ids.len()
    })
    .await;
    wait_until(DEADLINE, "the poison event's dead letter", || async {
        db.count("outbox_dead_letters").await == 1
    })
    .await;
    relay.stop().await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let dl = outbox_relay_ops::admin::list_dead_letters(&db.pool, &schema, 10)
        .await
        .unwrap();
    assert_eq!(dl[0].id, poison);
    assert!(dl[0].last_error.contains("255"), "{}", dl[0].last_error);
    assert_eq!(dl[0].attempts, 1, "dead-lettered at once, not retried");
    assert!(!collector.has(&poison.to_string()));
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

/// A dead letter whose id is back in the outbox (enqueued again) is kept
/// and reported by a replay, not deleted: both copies survive.
#[tokio::test]
async fn replaying_a_dead_letter_whose_id_is_in_the_outbox_keeps_it() {
    let db = TestDb::producer("relay_replay_conflict").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let ob = db.outbox(Capture::Table).await;
    let event = || {
        NewEvent::new("order", "o-1", "OrderPlaced", &json!({"n": 1}))
            .unwrap()
            .id_from_key("k-1")
    };
    let mut tx = db.pool.begin().await.unwrap();
    let id = ob.enqueue(&mut *tx, event()).await.unwrap();
    tx.commit().await.unwrap();
    // Dead-lettered (as the relay would), then enqueued again.
    outbox_relay_ops::admin::skip_events(&db.pool, &schema, &[id], "test")
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    ob.enqueue(&mut *tx, event()).await.unwrap();
    tx.commit().await.unwrap();
    let replayed = outbox_relay_ops::admin::replay_dead_letters(
        &db.pool,
        &schema,
        &outbox_relay_ops::admin::Selection::All,
        Duration::from_secs(3600),
        None,
    )
    .await
    .unwrap();
    assert_eq!(replayed.replayed, 0);
    assert_eq!(replayed.conflicts, [id]);
    assert_eq!(
        db.count("outbox_dead_letters").await,
        1,
        "the dead letter was lost"
    );
    assert_eq!(db.count("outbox").await, 1);
    db.cleanup().await;
}

/// What no retry can fix ends `run` with an error at once instead of an
/// outage logged for ever: a refused login, a missing virtual host, and
/// `declare_exchange` of another type than the existing exchange's.
#[tokio::test]
async fn refusals_end_run_with_an_error_instead_of_retrying() {
    let db = TestDb::producer("relay_refused").await;
    let broker = TestBroker::new("refused", FieldTable::default()).await;
    let cases = [
        ("a refused login", {
            let url = amqp_url().replace("guest:guest", "guest:S3cret-wrong");
            TestRelay::new(&db, &broker).with(|c| c.amqp_url = url.into())
        }),
        ("a missing vhost", {
            let url = amqp_url().replace("%2f", "no-such-vhost");
            TestRelay::new(&db, &broker).with(|c| c.amqp_url = url.into())
        }),
        ("a conflicting declaration", {
            TestRelay::new(&db, &broker).with(|c| c.declare_exchange = Some("direct".into()))
        }),
    ];
    for (what, relay) in cases {
        let relay = relay.start().await;
        let ended = relay
            .join(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{what}: still retrying after 30 s"));
        let e = ended.expect_err(what);
        assert!(!e.is_transient(), "{what}: {e}");
        assert!(!format!("{e} {e:?}").contains("S3cret"), "{what}: {e}");
    }
    db.cleanup().await;
    broker.cleanup().await;
}

/// The relay's gauges read no table whole, yet on a small outbox they are
/// exact and agree with `status`.
#[tokio::test]
async fn gauges_are_exact_on_a_small_outbox_and_agree_with_status() {
    let db = TestDb::producer("relay_gauges").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let ids = db.produce(30, 10, Duration::ZERO).await;
    let dead: Vec<uuid::Uuid> = ids[..2].iter().map(|i| i.parse().unwrap()).collect();
    outbox_relay_ops::admin::skip_events(&db.pool, &schema, &dead, "test")
        .await
        .unwrap();
    // One blocked ordered aggregate: its head failed once.
    outbox::set_ordered(&db.pool, &db.schema, "account", true)
        .await
        .unwrap();
    let ob = db.outbox(Capture::Table).await;
    let mut tx = db.pool.begin().await.unwrap();
    for n in 0..3 {
        ob.enqueue(
            &mut *tx,
            NewEvent::new("account", "a-1", "Changed", &json!({ "n": n })).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox SET attempts = 1 WHERE aggregate_seq = 1",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let g = outbox_relay_ops::admin::gauges(&db.pool, &schema)
        .await
        .unwrap();
    let s = outbox_relay_ops::admin::status(&db.pool, &schema)
        .await
        .unwrap();
    assert_eq!(g.backlog, 31);
    assert_eq!(g.backlog, s.backlog);
    assert_eq!(g.dead_letters, 2);
    assert_eq!(g.dead_letters, s.dead_letters);
    assert_eq!(g.blocked_aggregates, 1);
    assert_eq!(g.blocked_aggregates, s.blocked_aggregates);
    assert!(g.oldest_due_age_s >= 0.0);
    db.cleanup().await;
}
