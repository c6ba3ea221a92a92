//! The relay engine in-process against the real services: what it holds
//! and for how long (database connections idle and busy, a batch's
//! transaction under a slow broker, the drain on shutdown) and how its
//! claims read the outbox. The rest: `relay.rs`.

use std::time::Duration;

use e2e::{Collector, RunningRelay, TestBroker, TestDb, TestRelay, amqp_url, wait_until};
use lapin::types::FieldTable;
use outbox::{Capture, NewEvent};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

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
    let ob = db.outbox(Capture::Table).await;
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
