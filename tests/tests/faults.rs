//! Fault injection across the whole path: producer → outbox → relay →
//! RabbitMQ → dedup consumer → effect. Every scenario asserts one oracle:
//! the set of committed event ids equals the set of applied effects, and
//! no effect is applied twice. Duplicates on the wire are counted and
//! reported, not failures.

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use e2e::{Collector, Mode, Proxy, TestBroker, TestDb, amqp_url, database_url, suffix, wait_until};
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use outbox::{NewEvent, Outbox, OutboxConfig};
use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome};
use outbox_relay::{Relay, RelayConfig};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(120);

/// Event counts scale with `FAULT_SCALE` (default 1; `make soak` uses 10).
fn scaled(n: usize) -> usize {
    n * std::env::var("FAULT_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1usize)
        .max(1)
}

/// One scenario's world: producer schema, consumer schema with an effects
/// table, an exchange with the consumer's queue and a wire-counting queue.
struct World {
    db: TestDb,
    consumer_schema: String,
    broker: TestBroker,
    wire: Collector,
    wire_queue: String,
}

impl World {
    async fn new(prefix: &str) -> Self {
        let db = TestDb::producer(prefix).await;
        let consumer_schema = format!("{}_c", db.schema);
        outbox_consumer::migrate(&db.pool, &consumer_schema)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE \"{consumer_schema}\".effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT now())"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let broker = TestBroker::new(prefix, FieldTable::default()).await;
        // A second queue on the same exchange counts what the relay put on
        // the wire, duplicates included.
        let wire_queue = format!("{}.wire", broker.queue);
        let conn = e2e::connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            wire_queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            wire_queue.as_str().into(),
            broker.exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let _ = conn.close(200, "ok".into()).await;
        let wire = Collector::start(&wire_queue);
        Self {
            db,
            consumer_schema,
            broker,
            wire,
            wire_queue,
        }
    }

    fn relay_config(&self, amqp: String) -> RelayConfig {
        RelayConfig {
            amqp_url: amqp,
            schema: self.db.schema.clone(),
            default_exchange: self.broker.exchange.clone(),
            declare_exchange: None,
            batch_size: 100,
            poll_interval: Duration::from_millis(200),
            confirm_timeout: Duration::from_secs(2),
            broker_timeout: Duration::from_secs(2),
            reconnect_min: Duration::from_millis(50),
            reconnect_max: Duration::from_millis(500),
            ..RelayConfig::default()
        }
    }

    async fn relay(&self, app: &str, amqp: String) -> Running<outbox_relay::Error> {
        let pool = e2e::pool(app, 4).await;
        let relay = Relay::new(pool, self.relay_config(amqp)).await.unwrap();
        Running::spawn(|stop| tokio::spawn(async move { relay.run(stop).await }))
    }

    async fn consumer(&self, app: &str) -> Running<outbox_consumer::Error> {
        let pool = e2e::pool(app, 4).await;
        let mut config = ConsumerConfig::new(amqp_url(), &self.broker.queue, "faults")
            .schema(&self.consumer_schema);
        config.declare_retry_queues = false;
        config.max_reconnect_delay = Duration::from_millis(500);
        let insert = format!(
            "INSERT INTO \"{}\".effects (event_id) VALUES ($1)",
            self.consumer_schema
        );
        let consumer = Consumer::new(config, pool, Effect { insert }).unwrap();
        Running::spawn(|stop| tokio::spawn(async move { consumer.run(stop).await }))
    }

    fn process(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("DATABASE_URL", database_url())
            .env("AMQP_URL", amqp_url())
            .env("SCHEMA", &self.db.schema)
            .env("EXCHANGE", &self.broker.exchange)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }

    fn consumer_process(&self) -> Command {
        let mut c = self.process(env!("CARGO_BIN_EXE_fault-consumer"));
        c.env("SCHEMA", &self.consumer_schema)
            .env("QUEUE", &self.broker.queue);
        c
    }

    async fn effects(&self) -> (i64, i64) {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT event_id) FROM \"{}\".effects",
            self.consumer_schema
        )))
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// The oracle. Waits for every committed event's effect, then checks
    /// the sets and that nothing was applied twice.
    async fn assert_exactly_once(&self, committed: &[String], scenario: &str) {
        let n = committed.len() as i64;
        wait_until(DEADLINE, &format!("{scenario}: {n} effects"), || async {
            self.effects().await.1 >= n
        })
        .await;
        let applied: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT event_id FROM \"{}\".effects",
            self.consumer_schema
        )))
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        let distinct: HashSet<&String> = applied.iter().collect();
        let expected: HashSet<&String> = committed.iter().collect();
        assert_eq!(
            distinct, expected,
            "{scenario}: applied effects differ from committed events"
        );
        assert_eq!(
            applied.len(),
            distinct.len(),
            "{scenario}: an effect was applied twice"
        );
        // The wire counter only reports duplicates (not a guarantee): its
        // own queue can lag behind a broker restart, so it gets a bounded
        // wait and a note instead of a failure.
        let counted = tokio::time::timeout(Duration::from_secs(30), async {
            while self.wire.distinct() < committed.len() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if counted.is_err() {
            println!(
                "{scenario}: wire counter saw {} of {n} events",
                self.wire.distinct()
            );
        }
        let dups = self.wire.received.lock().unwrap().duplicates();
        println!(
            "{scenario}: events {n}, duplicates on the wire {dups}, effects applied {}",
            applied.len()
        );
    }

    async fn cleanup(self) {
        self.wire.stop();
        let conn = e2e::connect().await;
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(self.wire_queue.as_str().into(), Default::default())
                .await;
        }
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.consumer_schema
        )))
        .execute(&self.db.pool)
        .await;
        self.db.cleanup().await;
        self.broker.cleanup().await;
    }
}

/// A component running in-process until `stop`.
struct Running<E> {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), E>>,
}

impl<E: std::fmt::Debug> Running<E> {
    fn spawn(f: impl FnOnce(CancellationToken) -> tokio::task::JoinHandle<Result<(), E>>) -> Self {
        let stop = CancellationToken::new();
        let task = f(stop.clone());
        Self { stop, task }
    }

    /// Stops it and checks it ended cleanly.
    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

struct Effect {
    insert: String,
}

impl Handler for Effect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        match sqlx::query(AssertSqlSafe(self.insert.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

/// Commits `n` events, `per_tx` per transaction, pausing `pace` between
/// transactions; returns the committed ids.
fn produce(
    db: &TestDb,
    n: usize,
    per_tx: usize,
    pace: Duration,
) -> tokio::task::JoinHandle<Vec<String>> {
    let db = db.clone();
    tokio::spawn(async move { db.produce(n, per_tx, pace).await })
}

fn signal(child: &Child, sig: Signal) {
    kill(Pid::from_raw(child.id() as i32), sig).expect("signal");
}

fn kill_now(mut child: Child) {
    signal(&child, Signal::SIGKILL);
    child.wait().unwrap();
}

async fn terminate_backends(pool: &PgPool, application_name: &str, query_like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE application_name = $1 AND query LIKE $2 AND pid <> pg_backend_pid()",
    )
    .bind(application_name)
    .bind(query_like)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn relay_sigkilled_at_random_points_repeatedly() {
    let w = World::new("f_kill").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let producer = produce(&w.db, scaled(4_000), 20, Duration::from_millis(2));
    let mut kills = 0;
    for round in 0..8u64 {
        let before = w.wire.distinct();
        let child = w
            .process(env!("CARGO_BIN_EXE_fault-relay"))
            .spawn()
            .unwrap();
        wait_until(DEADLINE, "relay progress", || async {
            w.wire.distinct() > before || producer.is_finished() && w.db.count("outbox").await == 0
        })
        .await;
        tokio::time::sleep(Duration::from_millis((round * 37) % 90)).await;
        kill_now(child);
        kills += 1;
    }
    let ids = producer.await.unwrap();
    let child = w
        .process(env!("CARGO_BIN_EXE_fault-relay"))
        .spawn()
        .unwrap();
    w.assert_exactly_once(&ids, &format!("relay SIGKILLed {kills}x"))
        .await;
    kill_now(child);
    consumer.stop().await;
    w.cleanup().await;
}

#[tokio::test]
async fn relay_sigstopped_holding_locks_while_a_second_relay_runs() {
    let w = World::new("f_stop").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let backlog = produce(&w.db, scaled(5_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let a = w
        .process(env!("CARGO_BIN_EXE_fault-relay"))
        .env("BATCH_SIZE", "500")
        .spawn()
        .unwrap();
    // Stop relay A mid-batch: retry until the stop catches it holding row
    // locks (rows a SKIP LOCKED claim cannot see).
    let outbox = format!("\"{}\".outbox", w.db.schema);
    let mut locked = 0;
    for _ in 0..50 {
        wait_until(DEADLINE, "relay A progress", || async {
            w.wire.distinct() > 0
        })
        .await;
        signal(&a, Signal::SIGSTOP);
        let (all, free): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {outbox}), (SELECT count(*) FROM (SELECT 1 FROM {outbox} FOR UPDATE SKIP LOCKED) f)"
        )))
        .fetch_one(&w.db.pool)
        .await
        .unwrap();
        locked = all - free;
        if locked > 0 {
            break;
        }
        signal(&a, Signal::SIGCONT);
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    assert!(locked > 0, "never caught relay A holding locks");
    // The second relay skips A's rows and keeps the rest flowing, more
    // events keep coming, and A's rows come free when its frozen session
    // times out (idle_in_transaction_session_timeout).
    let b = w
        .process(env!("CARGO_BIN_EXE_fault-relay"))
        .spawn()
        .unwrap();
    let more = produce(&w.db, scaled(1_000), 20, Duration::from_millis(2))
        .await
        .unwrap();
    let mut ids = backlog;
    ids.extend(more);
    wait_until(
        DEADLINE,
        "relay B to deliver everything, A's rows included",
        || async { w.wire.distinct() >= ids.len() },
    )
    .await;
    signal(&a, Signal::SIGCONT);
    w.assert_exactly_once(
        &ids,
        &format!(
            "relay SIGSTOPped holding {locked} row locks, then SIGCONTed, beside a second relay"
        ),
    )
    .await;
    kill_now(a);
    kill_now(b);
    consumer.stop().await;
    w.cleanup().await;
}

#[tokio::test]
async fn database_backends_of_relay_and_consumer_terminated() {
    let w = World::new("f_pgkill").await;
    let (relay_app, consumer_app) = (format!("r-{}", suffix()), format!("c-{}", suffix()));
    let relay = w.relay(&relay_app, amqp_url()).await;
    let consumer = w.consumer(&consumer_app).await;
    let producer = produce(&w.db, scaled(3_000), 20, Duration::from_millis(2));
    let mut kills = 0;
    while !producer.is_finished() {
        kills += terminate_backends(&w.db.pool, &relay_app, "%").await;
        kills += terminate_backends(&w.db.pool, &consumer_app, "%").await;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let ids = producer.await.unwrap();
    assert!(kills > 0);
    w.assert_exactly_once(
        &ids,
        &format!("{kills} relay and consumer backends terminated"),
    )
    .await;
    relay.stop().await;
    consumer.stop().await;
    w.cleanup().await;
}

#[tokio::test]
async fn consumer_sigkilled_between_commit_and_ack() {
    let w = World::new("f_ckill").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let producer = produce(&w.db, scaled(3_000), 20, Duration::from_millis(1));
    // Kill the consumer process again and again while it works: with
    // batches committing every few ms, kills land between a commit and
    // its ack; the redeliveries must be recognised as duplicates.
    let mut kills = 0;
    for round in 0..10u64 {
        let (before, _) = w.effects().await;
        let child = w.consumer_process().spawn().unwrap();
        wait_until(DEADLINE, "consumer progress", || async {
            w.effects().await.0 > before
                || producer.is_finished() && w.effects().await.1 >= scaled(3_000) as i64
        })
        .await;
        tokio::time::sleep(Duration::from_millis((round * 13) % 40)).await;
        kill_now(child);
        kills += 1;
    }
    let ids = producer.await.unwrap();
    let child = w.consumer_process().spawn().unwrap();
    w.assert_exactly_once(&ids, &format!("consumer SIGKILLed {kills}x"))
        .await;
    kill_now(child);
    relay.stop().await;
    w.cleanup().await;
}

#[tokio::test]
async fn connection_cut_between_publish_and_confirm() {
    let w = World::new("f_cut").await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let relay = w
        .relay(&format!("r-{}", suffix()), proxy.url(&amqp_url()))
        .await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let producer = produce(&w.db, scaled(3_000), 50, Duration::from_millis(3));
    let faults = [
        Mode::CutAfter(3_000),
        Mode::Blackhole,
        Mode::Reset,
        Mode::CutAfter(20_000),
        Mode::Blackhole,
    ];
    for mode in faults {
        let seen = w.wire.distinct();
        wait_until(DEADLINE, "progress before the fault", || async {
            w.wire.distinct() > seen || producer.is_finished()
        })
        .await;
        proxy.set(mode);
        // Blackhole: publishes vanish and confirms never come; the relay's
        // confirm timeout (2 s) must fire, not hang.
        tokio::time::sleep(Duration::from_millis(if mode == Mode::Blackhole {
            2_500
        } else {
            100
        }))
        .await;
        proxy.set(Mode::Pass);
    }
    let ids = producer.await.unwrap();
    w.assert_exactly_once(
        &ids,
        &format!(
            "broker connection cut {} ways ({} connections)",
            faults.len(),
            proxy.connections()
        ),
    )
    .await;
    assert!(
        proxy.connections() > 1,
        "the relay reconnected through the proxy"
    );
    relay.stop().await;
    consumer.stop().await;
    proxy.stop();
    w.cleanup().await;
}

#[tokio::test]
async fn relay_notification_connection_killed_polling_catches_up() {
    let w = World::new("f_listen").await;
    let app = format!("r-{}", suffix());
    let relay = w.relay(&app, amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    // Wait for the relay's LISTEN session, then kill it, again and again.
    wait_until(DEADLINE, "the relay's LISTEN session", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'")
            .bind(&app)
            .fetch_one(&w.db.pool)
            .await
            .unwrap()
            > 0
    })
    .await;
    let producer = produce(&w.db, scaled(1_000), 10, Duration::from_millis(5));
    let mut kills = 0;
    while !producer.is_finished() {
        kills += terminate_backends(&w.db.pool, &app, "LISTEN%").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids = producer.await.unwrap();
    assert!(kills > 0, "the LISTEN session was never terminated");
    w.assert_exactly_once(&ids, &format!("LISTEN session terminated {kills}x"))
        .await;
    relay.stop().await;
    consumer.stop().await;
    w.cleanup().await;
}

#[tokio::test]
async fn producer_transaction_committing_late_with_an_earlier_id() {
    let w = World::new("f_late").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let ob = Outbox::new(&w.db.pool, OutboxConfig::default().schema(&w.db.schema))
        .await
        .unwrap();
    // The late transaction takes its (earlier, time-ordered) id first...
    let mut late = w.db.pool.begin().await.unwrap();
    let early_id = ob
        .enqueue(
            &mut *late,
            NewEvent::new("order", "late", "OrderPlaced", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    // ...while later ids commit and are published first.
    let ids = produce(&w.db, scaled(500), 10, Duration::ZERO)
        .await
        .unwrap();
    wait_until(DEADLINE, "the later events", || async {
        w.effects().await.1 >= scaled(500) as i64
    })
    .await;
    assert!(
        ids.iter()
            .all(|id| id.as_str() > early_id.to_string().as_str()),
        "the late event's id sorts first"
    );
    ob.commit(late).await.unwrap();
    let mut all = ids;
    all.push(early_id.to_string());
    w.assert_exactly_once(&all, "a transaction committing late with an earlier id")
        .await;
    relay.stop().await;
    consumer.stop().await;
    w.cleanup().await;
}

/// Restarts the shared broker and closes every connection: run alone
/// (`make test` runs `disruptive_` tests after the others).
#[tokio::test]
async fn disruptive_broker_restart_and_forced_connection_close() {
    let w = World::new("f_brk").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let producer = produce(&w.db, scaled(3_000), 20, Duration::from_millis(3));
    wait_until(DEADLINE, "progress", || async { w.effects().await.1 > 0 }).await;
    let ok = Command::new("rabbitmqctl")
        .args(["close_all_connections", "fault test"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "rabbitmqctl close_all_connections failed");
    let seen = w.effects().await.1;
    wait_until(DEADLINE, "progress after the forced close", || async {
        w.effects().await.1 > seen
    })
    .await;
    let ok = Command::new("rabbitmqctl")
        .arg("stop_app")
        .status()
        .unwrap()
        .success()
        && Command::new("rabbitmqctl")
            .arg("start_app")
            .status()
            .unwrap()
            .success();
    assert!(ok, "rabbitmqctl could not restart the broker");
    let ids = producer.await.unwrap();
    w.assert_exactly_once(
        &ids,
        "broker connections force-closed, then the broker restarted",
    )
    .await;
    relay.stop().await;
    consumer.stop().await;
    w.cleanup().await;
}
