//! Faults that last, against the `outbox-relay` binary as an operator runs
//! it: a database link that goes silent (no RST: old connections dead for
//! good, new ones pass once it heals) and a broker resource alarm held for
//! minutes. Events flow at a steady rate throughout, so each fault lands
//! on work in flight; the oracle judges once everything is quiet (every
//! committed event delivered, nothing else, a clean SIGTERM).

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e::{
    Collector, KillOnDrop, Mode, Proxy, TestBroker, TestDb, amqp_url, database_url, http_get,
    stop_child, suffix, wait_until,
};
use lapin::types::FieldTable;
use nix::sys::signal::Signal;
use outbox::Capture;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// The relay's bound on each database call in these tests.
const DATABASE_TIMEOUT: Duration = Duration::from_secs(3);

/// A relay process of the binary, its metrics on a port of its own and its
/// log (at `warn`) in a file, for the test to read.
struct RelayProcess {
    child: KillOnDrop,
    name: String,
    metrics: String,
    log: std::path::PathBuf,
}

impl RelayProcess {
    fn start(db: &TestDb, broker: &TestBroker, database: &str, batch_size: usize) -> Self {
        let name = format!("lasting-{}", suffix());
        let metrics = format!("127.0.0.1:{}", e2e::free_port());
        let log = std::env::temp_dir().join(format!("{name}.log"));
        let mut c = e2e::relay_command(BIN, db, broker);
        c.env("DATABASE_URL", database)
            .env("OUTBOX_BATCH_SIZE", batch_size.to_string())
            .env("OUTBOX_DATABASE_TIMEOUT", "3s")
            .env("OUTBOX_METRICS_ADDR", &metrics)
            .env("OUTBOX_RELAY_NAME", &name)
            .env("RUST_LOG", "warn,outbox_relay=info")
            .stderr(std::fs::File::create(&log).unwrap());
        if db.capture == Capture::Wal {
            c.env("OUTBOX_WAL_SENDER_TIMEOUT", "3s");
        }
        Self {
            child: KillOnDrop(c.spawn().unwrap()),
            name,
            metrics,
            log,
        }
    }

    async fn readyz(&self) -> Option<(u16, String)> {
        http_get(&self.metrics, "/readyz").await
    }

    /// The value of the metric line starting with `name`.
    async fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = http_get(&self.metrics, "/metrics").await?;
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its resident memory (`VmRSS`), in KiB.
    fn rss_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.0.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS")
    }

    /// SIGTERM; asserts a clean exit.
    async fn stop(mut self, scenario: &str) {
        let code = stop_child(&mut self.child, Signal::SIGTERM, Duration::from_secs(60)).await;
        assert_eq!(code, Some(0), "{scenario}: a clean stop\n{}", self.log());
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Asserts every committed event reached the queue, nothing else.
async fn all_delivered(collector: &Collector, ids: &[String], scenario: &str) {
    collector.drain(Duration::from_secs(120)).await;
    let got = collector.received.lock().unwrap();
    let seen: HashSet<&String> = got.counts.keys().collect();
    let missing = ids.iter().filter(|id| !seen.contains(id)).count();
    assert_eq!(
        missing, 0,
        "{scenario}: {missing} committed events never published"
    );
    assert_eq!(seen.len(), ids.len(), "{scenario}: events nobody committed");
}

/// Waits until the collector holds more distinct events than `than`;
/// returns how long after `from` that was.
async fn next_event_after(
    collector: &Collector,
    than: usize,
    from: Instant,
    what: &str,
) -> Duration {
    wait_until(Duration::from_secs(120), what, || async {
        collector.distinct() > than
    })
    .await;
    from.elapsed()
}

async fn silent_database_link(capture: Capture) {
    let scenario = format!("silent database link ({capture:?})");
    let db = match capture {
        Capture::Wal => TestDb::producer_wal("silent_db_w").await,
        _ => TestDb::producer("silent_db_t").await,
    };
    let broker = TestBroker::new("silent_db", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let relay = RelayProcess::start(&db, &broker, &proxy.url(&database_url()), 100);
    // About 250 events a second from producers that do not go through the
    // proxy.
    let stop = CancellationToken::new();
    let producing = db.produce_until(stop.clone(), 5, Duration::from_millis(20));
    wait_until(Duration::from_secs(60), "the relay publishing", || async {
        collector.distinct() > 500
    })
    .await;
    wait_until(Duration::from_secs(30), "/readyz 200", || async {
        relay.readyz().await.is_some_and(|(s, _)| s == 200)
    })
    .await;

    // The link goes silent for every connection, old and new.
    proxy.set(Mode::Blackhole);
    let silent = Instant::now();
    wait_until(Duration::from_secs(60), "/readyz 503", || async {
        relay.readyz().await.is_some_and(|(s, _)| s == 503)
    })
    .await;
    let noticed = silent.elapsed();
    // Within the bound: one call's timeout after the next call (the poll
    // interval), with a call's timeout again of slack for a busy machine.
    assert!(
        noticed <= DATABASE_TIMEOUT * 2 + Duration::from_secs(1),
        "{scenario}: /readyz said 503 only after {noticed:?}"
    );
    wait_until(Duration::from_secs(30), "one warning", || async {
        relay.log().contains("database unavailable")
    })
    .await;
    // The fault lasts: several bounds, the server's own timeouts included.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let (status, body) = relay.readyz().await.expect("/readyz answers");
    assert_eq!(status, 503, "{scenario}: still not ready: {body}");

    // The link heals for new connections; the old ones stay dead.
    let before = collector.distinct();
    proxy.set(Mode::Silent);
    let resumed =
        next_event_after(&collector, before, Instant::now(), "publishing to resume").await;
    assert!(
        resumed <= Duration::from_secs(5),
        "{scenario}: publishing resumed {resumed:?} after the heal"
    );
    wait_until(Duration::from_secs(30), "/readyz 200 again", || async {
        relay.readyz().await.is_some_and(|(s, _)| s == 200)
    })
    .await;
    assert!(
        proxy.dead() > 0,
        "{scenario}: no connection was on the link"
    );
    let log = relay.log();
    let warnings = log.matches("database unavailable").count();
    assert_eq!(warnings, 1, "{scenario}: one warning per outage\n{log}");

    stop.cancel();
    let ids = producing.await.unwrap();
    wait_until(
        Duration::from_secs(120),
        "every event published",
        || async { collector.distinct() >= ids.len() },
    )
    .await;
    relay.stop(&scenario).await;
    all_delivered(&collector, &ids, &scenario).await;
    println!(
        "{scenario}: {} events; /readyz 503 after {noticed:?}; publishing resumed {resumed:?} after the heal; {} connections left dead; {} duplicates",
        ids.len(),
        proxy.dead(),
        collector.duplicates()
    );
    proxy.stop();
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_database_link_table() {
    silent_database_link(Capture::Table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_database_link_wal() {
    silent_database_link(Capture::Wal).await;
}

/// A memory alarm on the test broker, cleared when dropped (a failing test
/// must not leave the broker blocking everyone else's publishers), and by a
/// dead man's switch a minute after it was due, should the test be killed
/// before it could drop it. The broker is the one `TEST_AMQP_URL` and
/// `TEST_RABBITMQCTL` name: `make test` runs this test on the standalone
/// node of `scripts/cluster.sh`.
struct Alarm;

const CLEAR_ALARM: &str = "rabbit_alarm:clear_alarm({resource_limit, memory, node()}).";

impl Alarm {
    fn set(lasting: Duration) -> Self {
        let switch = format!(
            "sleep {}; {} eval '{CLEAR_ALARM}' >/dev/null 2>&1",
            lasting.as_secs() + 60,
            e2e::rabbitmqctl().join(" ")
        );
        // `setsid --fork`: the switch outlives this process, and the
        // command returns at once.
        let armed = Command::new("setsid")
            .args(["--fork", "sh", "-c", &switch])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(armed, "the alarm's dead man's switch did not start");
        rabbitmqctl_eval("rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).");
        Self
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        rabbitmqctl_eval(CLEAR_ALARM);
    }
}

/// `rabbitmqctl` of the test broker ([`e2e::rabbitmqctl`]) with `args`.
fn rabbitmqctl<const N: usize>(args: [&str; N]) -> Command {
    let line = e2e::rabbitmqctl();
    let mut c = Command::new(&line[0]);
    c.args(&line[1..]).args(args);
    c
}

fn rabbitmqctl_eval(expr: &str) {
    let ok = rabbitmqctl(["eval", expr])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "rabbitmqctl eval {expr} failed");
}

/// The broker's connections, one `client_properties` line each: one
/// `rabbitmqctl` a look (each boots a VM: about 0.6 s of CPU, which the
/// tests beside this one need).
fn broker_connections() -> String {
    let out = rabbitmqctl(["list_connections", "-q", "client_properties"])
        .output()
        .expect("rabbitmqctl list_connections");
    assert!(out.status.success(), "rabbitmqctl list_connections failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// How many of `listed` ([`broker_connections`]) are named exactly `name`
/// (`outbox-relay <relay>`, `outbox-consumer <consumer>`).
fn named(listed: &str, name: &str) -> usize {
    listed.matches(&format!("\"{name}\"")).count()
}

/// How long the alarm lasts (`ALARM_SECONDS`, default 300).
fn alarm_length() -> Duration {
    Duration::from_secs(
        std::env::var("ALARM_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(300),
    )
}

/// A dedup consumer of a table relay's exchange during the alarm, every
/// event's first attempt retried: its republishes to the retry queue and
/// its acks meet the block.
struct WatchedConsumer {
    name: String,
    schema: String,
    queue: String,
    pool: sqlx::PgPool,
    consumer: outbox_consumer::Consumer,
    stop: CancellationToken,
    running: Option<tokio::task::JoinHandle<outbox_consumer::Result<()>>>,
}

impl WatchedConsumer {
    async fn start(db: &TestDb, broker: &TestBroker) -> Self {
        let name = format!("alarm-{}", suffix());
        let schema = format!("{}_c", db.schema);
        let queue = format!("{}.c", broker.queue);
        outbox_consumer::migrate(&db.pool, &schema).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".effects (event_id text NOT NULL)"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let conn = e2e::connect().await;
        let topology = outbox_consumer::TopologyConfig::new(&queue, &broker.exchange, "#");
        outbox_consumer::declare_topology(&conn, &topology)
            .await
            .unwrap();
        let _ = conn.close(200, "declared".into()).await;
        let mut config = outbox_consumer::ConsumerConfig::new(amqp_url(), &queue, &name);
        config.schema = schema.clone();
        config.retry_delay = Duration::from_millis(100);
        config.max_retry_delay = Duration::from_millis(500);
        config.max_reconnect_delay = Duration::from_millis(500);
        let pool = e2e::pool(&name, 4).await;
        let effect = e2e::RecordEffect::new(&schema).retry_first();
        let consumer = outbox_consumer::Consumer::new(config, pool.clone(), effect).unwrap();
        Self {
            name,
            schema,
            queue,
            pool,
            consumer,
            stop: CancellationToken::new(),
            running: None,
        }
    }

    /// Starts consuming: its queue has a backlog by now, so its first
    /// batches republish (and meet the block, if there is one).
    fn run(&mut self) {
        let (consumer, stop) = (self.consumer.clone(), self.stop.clone());
        self.running = Some(tokio::spawn(async move { consumer.run(stop).await }));
    }

    /// Effects applied, and distinct events among them.
    async fn effects(&self) -> (i64, i64) {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT event_id) FROM \"{}\".effects",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Asserts every event applied once, then stops and cleans up.
    async fn judge(self, ids: &[String], scenario: &str) {
        let n = ids.len() as i64;
        wait_until(
            Duration::from_secs(120),
            "the consumer's effects",
            || async { self.effects().await.1 >= n },
        )
        .await;
        assert_eq!(self.effects().await, (n, n), "{scenario}: each effect once");
        self.stop.cancel();
        let running = self.running.expect("the consumer ran");
        let ended = tokio::time::timeout(Duration::from_secs(60), running).await;
        assert!(
            matches!(ended, Ok(Ok(Ok(())))),
            "{scenario}: the consumer stops cleanly: {ended:?}"
        );
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA \"{}\" CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await
        .unwrap();
        let conn = e2e::connect().await;
        let ch = conn.create_channel().await.unwrap();
        for q in [
            self.queue.clone(),
            format!("{}.retry", self.queue),
            format!("{}.dlq", self.queue),
        ] {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let _ = conn.close(200, "cleaned up".into()).await;
    }
}

/// One relay of the alarm test: its world and what it must keep.
struct Watched {
    db: TestDb,
    broker: TestBroker,
    collector: Collector,
    relay: RelayProcess,
    /// Broker connections it needs (the table's workers; the log's reader).
    sessions: usize,
    /// One in-flight window: what a blocked batch may publish again.
    window: usize,
}

impl Watched {
    async fn start(capture: Capture) -> Self {
        let db = match capture {
            Capture::Wal => TestDb::producer_wal("alarm_w").await,
            _ => TestDb::producer("alarm_t").await,
        };
        let broker = TestBroker::new("alarm", FieldTable::default()).await;
        let collector = Collector::start(&broker.queue);
        let batch = 100;
        let relay = RelayProcess::start(&db, &broker, &database_url(), batch);
        let (sessions, window) = match capture {
            // The table's two workers, a batch each; the log's reader keeps
            // up to four batches' worth on the wire.
            Capture::Wal => (2, 4 * batch + 2 * batch),
            _ => (1, 2 * batch),
        };
        Self {
            db,
            broker,
            collector,
            relay,
            sessions,
            window,
        }
    }

    /// Events neither delivered nor dead: charged an attempt, or dead.
    async fn charged(&self) -> (i64, i64) {
        let schema = &self.db.schema;
        let charged: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\".outbox WHERE attempts > 0"
        )))
        .fetch_one(&self.db.pool)
        .await
        .unwrap();
        (charged, self.db.count("outbox_dead_letters").await)
    }
}

/// `make test` runs it on a broker of its own (the standalone node of
/// `scripts/cluster.sh`), beside the other tests: the alarm blocks every
/// publisher of its broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_broker_alarm_that_lasts_minutes() {
    let scenario = "broker alarm";
    let watched = [
        Watched::start(Capture::Table).await,
        Watched::start(Capture::Wal).await,
    ];
    // Judged with the table's relay, before its world is cleaned up.
    let mut consumer = Some(WatchedConsumer::start(&watched[0].db, &watched[0].broker).await);
    let blocked_now =
        |c: &Option<WatchedConsumer>| c.as_ref().is_some_and(|c| c.consumer.broker_blocked_now());
    let stop = CancellationToken::new();
    // About 50 events a second into each (`make test` runs this beside
    // the other tests: the backlog the alarm leaves is drained beside them).
    let producing: Vec<_> = watched
        .iter()
        .map(|w| {
            w.db.produce_until(stop.clone(), 1, Duration::from_millis(20))
        })
        .collect();
    for w in &watched {
        wait_until(Duration::from_secs(60), "the relays publishing", || async {
            w.collector.distinct() > 300
        })
        .await;
        wait_until(Duration::from_secs(30), "/readyz 200", || async {
            w.relay.readyz().await.is_some_and(|(s, _)| s == 200)
        })
        .await;
    }
    let rss_before: Vec<u64> = watched.iter().map(|w| w.relay.rss_kib()).collect();

    let alarm = Alarm::set(alarm_length());
    let set_at = Instant::now();
    // The consumer starts on a backlog of the table relay's events, so its
    // retries' republishes meet the block.
    if let Some(c) = consumer.as_mut() {
        c.run();
    }
    let mut most_connections = vec![0; watched.len()];
    for w in &watched {
        wait_until(
            Duration::from_secs(60),
            "/readyz to say blocked",
            || async {
                w.relay
                    .readyz()
                    .await
                    .is_some_and(|(s, b)| s == 503 && b.contains("blocked"))
            },
        )
        .await;
        assert_eq!(
            w.relay.metric("outbox_relay_broker_blocked").await,
            Some(1.0),
            "{scenario}: the gauge"
        );
    }
    wait_until(Duration::from_secs(60), "the consumer blocked", || async {
        blocked_now(&consumer)
    })
    .await;
    let consumer_name = consumer
        .as_ref()
        .map(|c| c.name.clone())
        .unwrap_or_default();
    // The alarm lasts; the relays' and the consumer's connections, memory
    // and attempts are watched throughout.
    while set_at.elapsed() < alarm_length() {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let listed = broker_connections();
        let n = named(&listed, &format!("outbox-consumer {consumer_name}"));
        // Its one connection, waiting the block out (none is named so
        // when the look is wrong).
        assert_eq!(n, 1, "{scenario}: broker connections of the consumer");
        for (i, w) in watched.iter().enumerate() {
            let n = named(&listed, &format!("outbox-relay {}", w.relay.name));
            most_connections[i] = most_connections[i].max(n);
            assert!(
                n <= w.sessions,
                "{scenario}: {n} broker connections of {} after {:?} (it needs {})",
                w.relay.name,
                set_at.elapsed(),
                w.sessions
            );
        }
    }
    let rss_blocked: Vec<u64> = watched.iter().map(|w| w.relay.rss_kib()).collect();
    for w in &watched {
        let (charged, dead) = w.charged().await;
        assert_eq!(
            (charged, dead),
            (0, 0),
            "{scenario}: attempts charged, dead letters"
        );
    }
    for (w, most) in watched.iter().zip(&most_connections) {
        // Each relay waited the block out on the connections it had (none
        // is named so when the look is wrong).
        assert!(
            *most >= 1,
            "{scenario}: no broker connection of {} seen during the alarm",
            w.relay.name
        );
    }
    let before: Vec<usize> = watched.iter().map(|w| w.collector.distinct()).collect();
    // Counted from when the broker has lifted the alarm: `rabbitmqctl`
    // boots a VM first, which takes seconds on a machine the other tests
    // keep busy (6.8 s counted from before it, once).
    let clearing = Instant::now();
    drop(alarm);
    let cleared_at = Instant::now();
    let clear_took = cleared_at - clearing;
    let mut resumed = Vec::new();
    for (w, before) in watched.iter().zip(&before) {
        let after =
            next_event_after(&w.collector, *before, cleared_at, "publishing to resume").await;
        assert!(
            after <= Duration::from_secs(5),
            "{scenario}: {:?}'s first event {after:?} after the clear (which took {clear_took:?})",
            w.db.capture
        );
        resumed.push(after);
    }
    for (i, w) in watched.iter().enumerate() {
        let grown = rss_blocked[i].saturating_sub(rss_before[i]);
        assert!(
            grown <= 16 * 1024,
            "{scenario}: RSS grew {grown} KiB during the alarm"
        );
        wait_until(Duration::from_secs(30), "/readyz 200 again", || async {
            w.relay.readyz().await.is_some_and(|(s, _)| s == 200)
        })
        .await;
    }
    assert!(
        !blocked_now(&consumer),
        "{scenario}: the consumer still blocked"
    );
    if let Some(c) = &consumer {
        // The block was waited out on the one connection: no session
        // failed, none reconnected.
        let stats = c.consumer.stats();
        assert_eq!(
            (stats.connections, stats.broker_errors),
            (1, 0),
            "{scenario}: the consumer's sessions and broker errors"
        );
    }
    stop.cancel();
    let mut report = Vec::new();
    for (i, (w, producing)) in watched.into_iter().zip(producing).enumerate() {
        let ids = producing.await.unwrap();
        wait_until(
            Duration::from_secs(120),
            "every event published",
            || async { w.collector.distinct() >= ids.len() },
        )
        .await;
        let duplicates = w.collector.duplicates();
        assert!(
            duplicates <= w.window,
            "{scenario}: {duplicates} duplicates, more than one in-flight window ({})",
            w.window
        );
        assert_eq!(w.charged().await, (0, 0), "{scenario}: nothing charged");
        w.relay.stop(scenario).await;
        all_delivered(&w.collector, &ids, scenario).await;
        if w.db.capture == Capture::Table {
            let consumer = consumer.take().expect("one consumer, of the table's relay");
            consumer.judge(&ids, scenario).await;
        }
        report.push(format!(
            "{:?}: {} events, RSS {} -> {} KiB, at most {} broker connections, first event {:?} after the clear (which took {clear_took:?}), {duplicates} duplicates",
            w.db.capture,
            ids.len(),
            rss_before[i],
            rss_blocked[i],
            most_connections[i],
            resumed[i]
        ));
        w.collector.stop();
        w.db.cleanup().await;
        w.broker.cleanup().await;
    }
    println!(
        "{scenario} of {:?}: {}; the consumer (every event retried once) applied each once",
        alarm_length(),
        report.join("; ")
    );
}
