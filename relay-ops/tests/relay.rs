//! The relay engine in-process against the real services.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{Collector, RunningRelay, TestBroker, TestDb, TestRelay, amqp_url, wait_until};
use lapin::types::{AMQPValue, FieldTable};
use outbox::{NewEvent, Outbox, OutboxConfig};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

async fn outbox(db: &TestDb) -> Outbox {
    Outbox::new(&db.pool, {
        let mut c = OutboxConfig::default();
        c.schema = db.schema.to_string();
        c
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn rolled_back_events_are_never_published_and_committed_ones_carry_the_contract() {
    let db = TestDb::producer("relay_contract").await;
    let broker = TestBroker::new("contract", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ob = outbox(&db).await;
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
    let ob = outbox(&db).await;
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
    let ob = outbox(&db).await;
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

/// A one-worker `relay` whose broker connection goes through a
/// fault proxy, running and connected.
async fn connected_through_proxy(relay: TestRelay) -> (e2e::Proxy, RunningRelay) {
    let proxy = e2e::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let pool = sqlx::PgPool::connect(&e2e::database_url()).await.unwrap();
    let relay = relay
        .with(|c| {
            c.amqp_url = proxy.url(&amqp_url()).into();
            c.workers = 1;
        })
        .pool(pool)
        .start()
        .await;
    wait_until(DEADLINE, "the relay connected", || async {
        relay.health().is_ready()
    })
    .await;
    (proxy, relay)
}

/// A slow broker cannot stretch a batch past its transaction's idle bound:
/// the publish phase has one deadline (here 4 s, inside the 9 s bound)
/// for exchange checks, publishes and confirms together, and whatever is
/// sent keeps its full confirm timeout. Forty events to forty exchanges
/// the relay has not seen, every round trip slowed to 100 ms, would take
/// about 12 s of checks in one batch; PostgreSQL would end the session
/// after the events went out, and they would go out again.
/// With the deadline, what is not sent waits for the next batch (checked
/// exchanges stay known): every event arrives once.
#[tokio::test]
async fn a_slow_broker_cannot_stretch_a_batch_past_its_idle_bound() {
    let db = TestDb::producer("relay_slow").await;
    let broker = TestBroker::new("slow", FieldTable::default()).await;
    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let exchanges: Vec<String> = (0..40)
        .map(|i| format!("{}.x{i}", broker.exchange))
        .collect();
    for x in &exchanges {
        ch.exchange_declare(
            x.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            broker.queue.as_str().into(),
            x.as_str().into(),
            "#".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    let collector = Collector::start(&broker.queue);
    let ob = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    let events = exchanges.iter().enumerate().map(|(i, x)| {
        NewEvent::new("order", format!("o-{i}"), "OrderPlaced", &json!({ "i": i }))
            .unwrap()
            .exchange(x.as_str())
    });
    let ids = ob.enqueue_many(&mut *tx, events).await.unwrap();
    ob.commit(tx).await.unwrap();

    let (proxy, relay) = connected_through_proxy(TestRelay::new(&db, &broker).with(|c| {
        c.confirm_timeout = Duration::from_secs(3);
        c.broker_timeout = Duration::from_secs(1);
    }))
    .await;
    // Connected at full speed, then slowed.
    proxy.set(e2e::Mode::Delay(Duration::from_millis(100)));
    wait_until(DEADLINE, "every event in the queue", || async {
        db.count("outbox").await == 0 && collector.distinct() == ids.len()
    })
    .await;
    relay.stop().await;
    // Quiet: the relay has stopped; anything still in flight has landed.
    wait_until(DEADLINE, "the queue drained", || async {
        e2e::depth(&conn, &broker.queue).await.0 == 0
    })
    .await;
    let dups = collector.received.lock().unwrap().duplicates();
    assert_eq!(dups, 0, "events published twice");
    collector.stop();
    proxy.stop();
    let _ = conn.close(200, "ok".into()).await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// An embedded relay honours `drain_timeout`: asked to stop while a batch
/// waits for confirms from a broker gone silent, it abandons the batch
/// after the drain timeout (rolled back: the events stay in the outbox)
/// and says so, instead of waiting for the confirm timeout.
#[tokio::test]
async fn shutdown_abandons_batches_in_flight_past_the_drain_timeout() {
    let db = TestDb::producer("relay_drain").await;
    let broker = TestBroker::new("drain", FieldTable::default()).await;
    let (proxy, relay) = connected_through_proxy(TestRelay::new(&db, &broker).with(|c| {
        c.confirm_timeout = Duration::from_secs(120);
        c.broker_timeout = Duration::from_secs(120);
        c.drain_timeout = Duration::from_secs(1);
    }))
    .await;
    proxy.set(e2e::Mode::Blackhole);
    let ids = db.produce(10, 10, Duration::ZERO).await;
    // In flight: the relay holds every row locked, waiting for confirms.
    let unlocked = sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT 1 FROM \"{}\".outbox FOR UPDATE SKIP LOCKED) x",
        db.schema
    )));
    wait_until(DEADLINE, "the batch in flight", || async {
        let mut tx = db.pool.begin().await.unwrap();
        let n: i64 = sqlx::query_scalar(unlocked.clone())
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        n == 0
    })
    .await;
    relay.cancel();
    let ended = relay
        .join(Duration::from_secs(30))
        .await
        .expect("run returned within the drain timeout, not the confirm timeout");
    assert!(
        matches!(ended, Err(outbox_relay::Error::DrainTimedOut(_))),
        "{ended:?}"
    );
    assert_eq!(db.count("outbox").await, ids.len() as i64, "events kept");
    proxy.stop();
    db.cleanup().await;
    broker.cleanup().await;
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
    let ob = outbox(&db).await;
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

/// A busy worker holds its database connection from batch to batch; an
/// idle relay gives them back to the pool (which a host service may share
/// with it): only its LISTEN session stays checked out.
#[tokio::test]
async fn an_idle_relay_holds_no_pooled_connection_but_its_listener() {
    let db = TestDb::producer("relay_idle_pool").await;
    let broker = TestBroker::new("idle_pool", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with((*db.pool.connect_options()).clone())
        .await
        .unwrap();
    let in_use = || pool.size() as usize - pool.num_idle();
    let relay = TestRelay::new(&db, &broker)
        .with(|c| c.batch_size = 50)
        .pool(pool.clone())
        .start()
        .await;
    let ids = db.produce(2_000, 100, Duration::ZERO).await;
    wait_until(Duration::from_secs(60), "every event published", || async {
        collector.distinct() >= ids.len()
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "the idle relay's workers to give their connections back",
        || async { in_use() <= 1 },
    )
    .await;
    relay.stop().await;
    collector.stop();
    pool.close().await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// While events trickle in, every event is followed by a claim that finds
/// nothing. A worker that wake-ups keep busy keeps its connection through
/// those: it gives it back (and sqlx pings every connection given back)
/// only when a wait passes with no wake-up.
#[tokio::test]
async fn a_worker_kept_busy_by_wake_ups_keeps_its_connection_between_events() {
    let db = TestDb::producer("relay_trickle_pool").await;
    let broker = TestBroker::new("trickle_pool", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let released = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .after_release({
            let released = released.clone();
            move |_, _| {
                released.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Box::pin(async { Ok(true) })
            }
        })
        .connect_with((*db.pool.connect_options()).clone())
        .await
        .unwrap();
    // No wait for work ends by the poll interval while the events come.
    let relay = TestRelay::new(&db, &broker)
        .with(|c| c.poll_interval = Duration::from_secs(10))
        .pool(pool.clone())
        .start()
        .await;
    // A first event wakes both workers: whatever a worker gave back
    // before it (at the start, when nothing had woken it) is not counted.
    db.produce(1, 1, Duration::ZERO).await;
    wait_until(
        Duration::from_secs(30),
        "the first event published",
        || async { collector.distinct() >= 1 },
    )
    .await;
    released.store(0, std::sync::atomic::Ordering::Relaxed);
    let n = 40;
    db.produce(n, 1, Duration::from_millis(20)).await;
    wait_until(Duration::from_secs(30), "every event published", || async {
        collector.distinct() > n
    })
    .await;
    let given_back = released.load(std::sync::atomic::Ordering::Relaxed);
    // Giving the connection back after each empty claim gave back about
    // two per event (both workers wake for each); the relay's other
    // statements (leases, stats) may give back one or two.
    assert!(
        given_back <= 3,
        "{given_back} connections given back to the pool while {n} events trickled in"
    );
    relay.stop().await;
    collector.stop();
    pool.close().await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// After five runs PostgreSQL may switch a prepared statement to one
/// generic plan, made with the table's size at that moment. A relay that
/// started on an empty outbox kept a claim plan that read the whole heap,
/// dead rows included, on every claim. Under the relay's own `BEGIN`, the
/// generic plans of the claims and the walk made on an empty outbox read a churned one
/// through its indexes (seen failing without `enable_seqscan = off`: a
/// sequential scan of the outbox in the ordered events' probe and in the
/// unordered claim).
#[tokio::test]
async fn a_claim_planned_on_an_empty_outbox_reads_it_through_its_indexes() {
    let db = TestDb::producer("relay_claim_plan").await;
    let broker = TestBroker::new("claim_plan", FieldTable::default()).await;
    let relay = TestRelay::new(&db, &broker).build().await;
    let [begin, batch, unordered, walk] = relay.batch_statements();
    let s = &db.schema;
    let mut conn = db.pool.acquire().await.unwrap();
    let nil = uuid::Uuid::nil();
    let claims = [
        Prepared {
            name: "batch",
            types: "(uuid, int4, int4, text[], text[], int8[], int8, timestamptz, uuid, timestamptz, uuid)",
            args: format!(
                "('{}', 1, 0, '{{}}', '{{}}', '{{}}', 500, NULL, '{nil}', NULL, '{nil}')",
                relay.id(),
            ),
            index: "outbox_due_idx",
        },
        Prepared {
            name: "plain",
            types: "(int8, timestamptz, uuid, timestamptz, uuid)",
            args: format!("(500, NULL, '{nil}', NULL, '{nil}')"),
            index: "outbox_due_idx",
        },
        Prepared {
            name: "walk",
            types: "(uuid, int4, int4, timestamptz, uuid, int8)",
            args: format!("('{}', 1, 0, NULL, '{nil}', 2000)", relay.id()),
            index: "outbox_ordered_due_idx",
        },
    ];
    for (claim, sql) in claims.iter().zip([batch, unordered, walk]) {
        claim.plan_generic(&mut conn, &begin, &sql).await;
    }
    // The churn of a busy outbox between two analyzes: 3,000 events of
    // each kind written and delivered, one left.
    run(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', i::text, 'Placed', jsonb_build_object('pad', repeat('x', 400))
         FROM generate_series(1, 3000) i;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', i::text, 'Changed', jsonb_build_object('pad', repeat('x', 400)), 1
         FROM generate_series(1, 3000) i;
         DELETE FROM \"{s}\".outbox;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'last', 'Placed', '{{}}');"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut scans = Vec::new();
    for claim in &claims {
        let plan = claim.explain(&mut conn, &begin).await;
        if plan.contains("Seq Scan on outbox ") || !plan.contains(claim.index) {
            scans.push((claim.name, plan));
        }
    }
    assert!(
        scans.is_empty(),
        "claims that scan the outbox's heap: {scans:#?}"
    );
    drop(conn);
    db.cleanup().await;
    broker.cleanup().await;
}

fn run(sql: String) -> sqlx::RawSql {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
}

/// A claim prepared by name, with its parameters' types and the arguments
/// it runs with.
struct Prepared {
    name: &'static str,
    types: &'static str,
    args: String,
    /// The index it must read the outbox through.
    index: &'static str,
}

impl Prepared {
    /// Prepares `sql` and runs it under `begin` on its generic plan, made
    /// on the outbox as it is. (PostgreSQL switches to it after five custom
    /// plans when it costs about as much; the full claim with no aggregate
    /// asked for plans cheaper custom, so the test forces it: the worst
    /// case either way.)
    async fn plan_generic(&self, conn: &mut sqlx::PgConnection, begin: &str, sql: &str) {
        let Self {
            name, types, args, ..
        } = self;
        run("SET plan_cache_mode = force_generic_plan".to_owned())
            .execute(&mut *conn)
            .await
            .unwrap();
        run(format!("PREPARE {name} {types} AS {sql}"))
            .execute(&mut *conn)
            .await
            .unwrap();
        for _ in 0..7 {
            run(format!("{begin}; EXECUTE {name} {args}; ROLLBACK"))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        let generic: i64 =
            sqlx::query_scalar("SELECT generic_plans FROM pg_prepared_statements WHERE name = $1")
                .bind(name)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert!(generic > 0, "the {name} claim runs on its generic plan");
    }

    /// The plan the claim runs with under `begin`, as `EXPLAIN ANALYZE`
    /// shows it.
    async fn explain(&self, conn: &mut sqlx::PgConnection, begin: &str) -> String {
        run(begin.to_owned()).execute(&mut *conn).await.unwrap();
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE {} {}",
            self.name, self.args
        )))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        run("ROLLBACK".to_owned())
            .execute(&mut *conn)
            .await
            .unwrap();
        plan.join("\n")
    }
}
