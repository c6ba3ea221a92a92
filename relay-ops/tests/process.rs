//! The `outbox-relay` binary as a process: SIGKILL at random points,
//! SIGTERM drain, broker restart, the CLI's errors and secrets.

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use e2e::{Collector, KillOnDrop, TestBroker, TestDb, database_url, http_get, output, wait_until};
use lapin::types::FieldTable;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

fn relay_cmd(db: &TestDb, broker: &TestBroker) -> Command {
    e2e::relay_command(BIN, db, broker)
}

fn signal(child: &Child, sig: Signal) {
    kill(Pid::from_raw(child.id() as i32), sig).expect("signal");
}

fn outbox_table(db: &TestDb) -> String {
    format!("\"{}\".outbox", db.schema)
}

/// The oracle, judged once everything is quiet: the outbox empties (with
/// the log's capture, whose events never enter it: every event reaches the
/// queue), the relay stops on SIGTERM (exit 0), the collector empties its
/// queue (nothing ready or unacknowledged); then every event is delivered,
/// nothing else.
async fn assert_all_delivered(
    db: &TestDb,
    relay: &mut KillOnDrop,
    collector: &Collector,
    ids: &[String],
    scenario: &str,
) {
    if db.capture == outbox::Capture::Wal {
        wait_until(
            Duration::from_secs(180),
            "every event on the queue",
            || async { collector.distinct() >= ids.len() },
        )
        .await;
    } else {
        wait_until(Duration::from_secs(180), "the outbox to empty", || async {
            db.count("outbox").await == 0
        })
        .await;
    }
    assert_eq!(
        e2e::stop_child(relay, Signal::SIGTERM, Duration::from_secs(60)).await,
        Some(0),
        "{scenario}: a clean stop"
    );
    collector.drain(Duration::from_secs(120)).await;
    let got = collector.received.lock().unwrap();
    let seen: HashSet<&String> = got.counts.keys().collect();
    assert_eq!(
        seen,
        ids.iter().collect(),
        "{scenario}: every event delivered, nothing else"
    );
    println!(
        "{scenario}: {} events, {} duplicates on the wire",
        ids.len(),
        got.duplicates()
    );
}

#[tokio::test]
async fn relay_sigkilled_inside_batches_again_and_again_loses_nothing() {
    let db = TestDb::producer("proc_kill").await;
    let broker = TestBroker::new("kill", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(20_000, 500, Duration::ZERO).await;
    // Each kill lands inside a batch: the relay is frozen until a freeze
    // catches it holding claimed rows (between claim, publish, confirm,
    // settle and commit), then killed.
    let (mut landed, mut tries) = (0, 0);
    let mut held = Vec::new();
    while landed < 10 && tries < 30 {
        tries += 1;
        let before = collector.distinct();
        let child = KillOnDrop(
            relay_cmd(&db, &broker)
                .env("OUTBOX_BATCH_SIZE", "100")
                .spawn()
                .unwrap(),
        );
        wait_until(
            Duration::from_secs(60),
            "progress before the kill",
            || async { collector.distinct() > before },
        )
        .await;
        let locked = e2e::freeze_mid_batch(&child, &db.pool, &outbox_table(&db), 200).await;
        if locked > 0 {
            landed += 1;
            held.push(locked);
        }
        e2e::kill_now(child);
    }
    assert_eq!(landed, 10, "10 kills landed inside a batch ({tries} tries)");
    let mut child = KillOnDrop(relay_cmd(&db, &broker).spawn().unwrap());
    assert_all_delivered(
        &db,
        &mut child,
        &collector,
        &ids,
        &format!("relay SIGKILLed {landed} times inside a batch holding {held:?} rows"),
    )
    .await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// Every database connection of the relay reset while it works, five
/// times (a restarted database, a dropped link): a busy worker holds its
/// connection from batch to batch and the pool pings one only after it sat
/// idle for 2 s, so batches run on dead ones; each such batch fails and is
/// retried like any database error, the dead connection is dropped, and
/// every event is still delivered once the database answers again.
#[tokio::test]
async fn database_connections_reset_under_the_relay_lose_nothing() {
    connections_reset_five_times(TestDb::producer("proc_pg_reset").await).await;
}

/// The same with the log's capture: the replication stream is reset with
/// the pool's connections; the reader starts again from the slot, and
/// every event is delivered.
#[tokio::test]
async fn database_connections_reset_under_the_log_reader_lose_nothing() {
    connections_reset_five_times(TestDb::producer_wal("proc_wal_reset").await).await;
}

async fn connections_reset_five_times(db: TestDb) {
    let wal = db.capture == outbox::Capture::Wal;
    let broker = TestBroker::new("pg_reset", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let url = url::Url::parse(&database_url()).unwrap();
    let upstream = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(5432)
    );
    let proxy = e2e::Proxy::start(upstream.parse().unwrap()).await;
    let mut relay = KillOnDrop(
        relay_cmd(&db, &broker)
            .env("DATABASE_URL", proxy.url(&database_url()))
            .env("OUTBOX_BATCH_SIZE", "50")
            .env("OUTBOX_CAPTURE", if wal { "wal" } else { "table" })
            .spawn()
            .unwrap(),
    );
    let mut ids = Vec::new();
    for round in 1..=5 {
        ids.extend(db.produce(500, 50, Duration::ZERO).await);
        let before = collector.distinct();
        wait_until(Duration::from_secs(60), "the relay publishing", || async {
            collector.distinct() > before
        })
        .await;
        let opened = proxy.connections();
        proxy.set(e2e::Mode::Reset);
        wait_until(
            Duration::from_secs(30),
            "every connection reset",
            || async { proxy.open() == 0 },
        )
        .await;
        proxy.set(e2e::Mode::Pass);
        wait_until(
            Duration::from_secs(60),
            &format!("round {round}: the relay connecting again"),
            || async { proxy.connections() > opened },
        )
        .await;
    }
    ids.extend(db.produce(500, 50, Duration::ZERO).await);
    assert_all_delivered(
        &db,
        &mut relay,
        &collector,
        &ids,
        "every database connection of the relay reset 5 times",
    )
    .await;
    println!(
        "{} database connections opened through the proxy",
        proxy.connections()
    );
    proxy.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn sigterm_finishes_the_batch_in_flight_and_exits_zero() {
    let db = TestDb::producer("proc_term").await;
    let broker = TestBroker::new("term", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(20_000, 1000, Duration::ZERO).await;
    let mut child = KillOnDrop(
        relay_cmd(&db, &broker)
            .env("OUTBOX_BATCH_SIZE", "1000")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until(Duration::from_secs(60), "publishing to start", || async {
        collector.distinct() > 0
    })
    .await;
    // Catch it inside a batch with more than two batches still unclaimed,
    // so the signal lands on work in flight and leaves work behind
    // whatever the timing.
    let table = outbox_table(&db);
    let mut locked = 0;
    for _ in 0..20 {
        locked = e2e::freeze_mid_batch(&child, &db.pool, &table, 200).await;
        if locked > 0 && db.count("outbox").await - locked > 2_000 {
            break;
        }
        signal(&child, Signal::SIGCONT);
        locked = 0;
    }
    assert!(
        locked > 0,
        "never caught the relay inside a batch with work left"
    );
    let mut err = child.stderr.take().expect("stderr");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut text);
        text
    });
    signal(&child, Signal::SIGTERM);
    signal(&child, Signal::SIGCONT);
    assert_eq!(
        e2e::wait_exit(&mut child, Duration::from_secs(60)).await,
        Some(0),
        "drained and exited 0"
    );
    let stderr = stderr.join().unwrap();
    assert!(
        !stderr.contains("ERROR"),
        "a clean shutdown logs no error: {stderr}"
    );
    // Nothing was left half-done: no row is locked, every event that left
    // the outbox was delivered, none still in it was published.
    let remaining: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {table} FOR UPDATE NOWAIT"
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let remaining: HashSet<String> = remaining.into_iter().map(|i| i.to_string()).collect();
    assert!(
        !remaining.is_empty(),
        "the relay went on claiming after SIGTERM instead of finishing its batch in flight"
    );
    collector.drain(Duration::from_secs(60)).await;
    for id in &ids {
        assert_eq!(
            collector.has(id),
            !remaining.contains(id),
            "event {id}: published iff it left the outbox"
        );
    }
    assert_eq!(collector.duplicates(), 0, "no fault: no copy");
    println!(
        "SIGTERM inside a batch of {locked}: {} delivered, {} left for the next run",
        ids.len() - remaining.len(),
        remaining.len()
    );
    db.cleanup().await;
    broker.cleanup().await;
}

/// Restarts the shared broker with a backlog in flight: run alone (`make
/// test` runs `disruptive_` tests after the others, one at a time).
#[tokio::test]
async fn disruptive_broker_restart_mid_stream_loses_nothing() {
    let db = TestDb::producer("proc_brk").await;
    let broker = TestBroker::new("brk", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(20_000, 500, Duration::ZERO).await;
    let log = std::env::temp_dir().join(format!("{}-broker-restart.log", db.schema));
    let mut child = KillOnDrop(
        relay_cmd(&db, &broker)
            .env("OUTBOX_BATCH_SIZE", "100")
            // The deployed default: info, and whatever the libraries log.
            .env_remove("RUST_LOG")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_until(Duration::from_secs(60), "a batch in flight", || async {
        e2e::locked_rows(&db.pool, &outbox_table(&db)).await > 0
    })
    .await;
    let left = db.count("outbox").await;
    assert!(
        left > 1_000,
        "the backlog drained before the restart ({left} left)"
    );
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
    assert_all_delivered(
        &db,
        &mut child,
        &collector,
        &ids,
        &format!("broker restart with {left} events left"),
    )
    .await;
    // A handled outage is a WARN with its cause, not an ERROR (lapin logs
    // its IO loop's view at ERROR: quiet unless RUST_LOG names it), and the
    // relay's own statements stay under the slow-statement threshold.
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(
        errors.is_empty(),
        "a handled broker restart logged ERROR lines:\n{}",
        errors.join("\n")
    );
    assert!(
        text.contains("WARN"),
        "the outage is logged at WARN:\n{text}"
    );
    assert!(
        !text.contains("slow statement"),
        "a statement over the slow-statement threshold:\n{text}"
    );
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn bad_configuration_gets_one_line_and_a_non_zero_exit_and_no_password_is_printed() {
    let db = TestDb::producer("proc_badcfg").await;
    let db_url = "postgres://postgres:pg-S3cret-pw@127.0.0.1:5432/test";
    let amqp = "amqp://guest:mq-S3cret-pw@127.0.0.1:5672/%2f";
    let base = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.env_clear()
            .env("DATABASE_URL", db_url)
            .env("AMQP_URL", amqp)
            .env("OUTBOX_SCHEMA", &db.schema)
            .args(args);
        c
    };
    // (arguments, what the error must say, environment overrides)
    type Case<'a> = (Vec<&'a str>, &'a str, Vec<(&'a str, &'a str)>);
    let cases: Vec<Case> = vec![
        (vec!["run", "--batch-size", "0"], "batch size", vec![]),
        (
            vec!["--schema", "Bad-Name", "status"],
            "invalid schema",
            vec![],
        ),
        (
            vec!["run", "--declare-exchange", "hash"],
            "exchange type",
            vec![],
        ),
        (
            vec!["run"],
            "cannot connect to the broker",
            vec![("AMQP_URL", "amqp://guest:mq-S3cret-pw@127.0.0.1:1/%2f")],
        ),
        (
            vec!["status"],
            "cannot connect to the database",
            vec![("DATABASE_URL", "postgres://u:pg-S3cret-pw@127.0.0.1:1/x")],
        ),
        // TLS is compiled in, on one provider (two would panic in rustls):
        // a TLS handshake with a plain AMQP port fails as a connect error.
        (
            vec!["run"],
            "cannot connect to the broker",
            vec![("AMQP_URL", "amqps://guest:mq-S3cret-pw@127.0.0.1:5672/%2f")],
        ),
        (
            vec!["status"],
            "cannot connect to the database",
            vec![(
                "DATABASE_URL",
                "postgres://postgres:pg-S3cret-pw@127.0.0.1:5672/test?sslmode=require",
            )],
        ),
        (
            vec!["run"],
            "amqp:// or amqps://",
            vec![("AMQP_URL", "http://guest:mq-S3cret-pw@x/")],
        ),
        // Several nodes: none answers (each password stays hidden), or
        // the second of the list is malformed (named by position).
        (
            vec!["run"],
            "cannot connect to the broker",
            vec![(
                "AMQP_URL",
                "amqp://guest:mq-S3cret-pw@127.0.0.1:1/%2f,amqp://guest:mq-S3cret-pw@127.0.0.1:2/%2f",
            )],
        ),
        (
            vec![
                "run",
                "--amqp-url",
                "amqp://guest:mq-S3cret-pw@127.0.0.1:1/%2f",
                "--amqp-url",
                "amqp:guest:mq-S3cret-pw@127.0.0.1:5672/%2f",
            ],
            "AMQP URL 2 of 2 is malformed",
            vec![],
        ),
        // Malformed URLs, from the environment and from flags: the
        // password sits where no parser looks for one.
        (
            vec!["run"],
            "AMQP URL is malformed",
            vec![("AMQP_URL", "amqp:guest:mq-S3cret-pw@127.0.0.1:5672/%2f")],
        ),
        (
            vec![
                "run",
                "--amqp-url",
                "amqp:guest:mq-S3cret-pw@127.0.0.1:5672/%2f",
            ],
            "AMQP URL is malformed",
            vec![],
        ),
        (
            vec!["run"],
            "AMQP URL is malformed",
            vec![(
                "AMQP_URL",
                "amqp://guest:mq-S3cret-pw@127.0.0.1:notaport/%2f",
            )],
        ),
        (
            vec!["run"],
            "AMQP URL",
            vec![("AMQP_URL", "amqp//guest:mq-S3cret-pw@127.0.0.1/")],
        ),
        (
            vec!["status"],
            "database URL is malformed",
            vec![(
                "DATABASE_URL",
                "postgres:u:pg-S3cret-pw@127.0.0.1:5432/test",
            )],
        ),
        (
            vec![
                "--database-url",
                "postgres:u:pg-S3cret-pw@127.0.0.1/x",
                "status",
            ],
            "database URL is malformed",
            vec![],
        ),
        (
            vec!["status"],
            "database URL is malformed",
            vec![(
                "DATABASE_URL",
                "postgres://u:pg-S3cret-pw@127.0.0.1:notaport/x",
            )],
        ),
        (
            vec!["status"],
            "no database URL",
            vec![("DATABASE_URL", "")],
        ),
    ];
    for (args, needle, env) in cases {
        let mut cmd = base(&args);
        for (k, v) in &env {
            if v.is_empty() {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let (code, text) = output(&mut cmd);
        assert_ne!(code, Some(0), "{args:?} should fail");
        assert!(
            code != Some(101) && !text.contains("panicked"),
            "{args:?} panicked: {text}"
        );
        assert!(
            text.contains(needle),
            "{args:?}: {text:?} should mention {needle:?}"
        );
        assert!(
            !text.contains("S3cret"),
            "{args:?} printed a password: {text}"
        );
        assert_eq!(
            text.trim_end().lines().count(),
            1,
            "{args:?}: one line, got {text:?}"
        );
    }
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["dead-letters", "replay", "--help"],
    ] {
        let (code, text) = output(&mut base(args));
        assert_eq!(code, Some(0));
        assert!(
            !text.contains("S3cret"),
            "--help printed a password: {text}"
        );
        assert!(text.contains("Usage: outbox-relay"), "{text}");
    }
    let (_, help) = output(&mut base(&["run", "--help"]));
    for flag in [
        "--amqp-url",
        "--batch-size",
        "--max-attempts",
        "--drain-timeout",
        "--metrics-addr",
        "[env: AMQP_URL]",
    ] {
        assert!(help.contains(flag), "run --help lacks {flag}");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn migrate_status_and_dead_letter_commands_work_end_to_end() {
    let db = TestDb::producer("proc_cli").await;
    let cmd = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.env("DATABASE_URL", database_url())
            .env("OUTBOX_SCHEMA", &db.schema)
            .env("RUST_LOG", "warn")
            .args(args);
        output(&mut c)
    };
    let (code, text) = cmd(&["migrate"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("up to date"), "{text}");
    // A dead letter to look at.
    let id = uuid::Uuid::now_v7();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, last_error)
         VALUES ($1, 'order', 'o-1', 'OrderPlaced', '{{}}', '{{}}', now() - interval '30 days', 10, 'returned: NO_ROUTE')",
        db.schema
    )))
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    let (code, text) = cmd(&["status", "--json"]);
    assert_eq!(code, Some(0), "{text}");
    let s: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(s["dead_letters"], 1);
    assert_eq!(s["backlog"], 0);
    let (_, text) = cmd(&["status"]);
    assert!(
        text.contains("dead letters") && text.contains('1'),
        "{text}"
    );
    let (_, text) = cmd(&["dead-letters", "list"]);
    assert!(
        text.contains(&id.to_string()) && text.contains("NO_ROUTE"),
        "{text}"
    );
    let (code, text) = cmd(&["dead-letters", "replay", &id.to_string()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("replayed 1"), "{text}");
    assert!(
        text.contains("older than the retention window"),
        "30-day-old replay warns: {text}"
    );
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(db.count("outbox_dead_letters").await, 0);
    let (code, _) = cmd(&["dead-letters", "purge"]);
    assert_ne!(code, Some(0), "purge needs --all or ids");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{0}\".outbox_dead_letters SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, created_at, 10, 'x' FROM \"{0}\".outbox",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let (code, text) = cmd(&["dead-letters", "purge", "--all"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("purged 1"), "{text}");
    db.cleanup().await;
}

#[tokio::test]
async fn metrics_health_and_readiness_are_served() {
    let db = TestDb::producer("proc_metrics").await;
    let broker = TestBroker::new("metrics", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(300, 100, Duration::ZERO).await;
    let addr = format!("127.0.0.1:{}", e2e::free_port());
    let mut child = e2e::KillOnDrop(
        relay_cmd(&db, &broker)
            .env("OUTBOX_METRICS_ADDR", &addr)
            .spawn()
            .unwrap(),
    );
    wait_until(Duration::from_secs(60), "all events", || async {
        collector.distinct() >= ids.len()
    })
    .await;
    wait_until(Duration::from_secs(30), "/healthz", || async {
        http_get(&addr, "/healthz")
            .await
            .is_some_and(|(s, b)| s == 200 && b.contains("ok"))
    })
    .await;
    wait_until(Duration::from_secs(30), "/readyz to say ready", || async {
        http_get(&addr, "/readyz")
            .await
            .is_some_and(|(s, b)| s == 200 && b.contains("broker node: 127.0.0.1:"))
    })
    .await;
    // The counters move after each batch commits, a moment after its
    // events reach the queue.
    let published_now = || async {
        let (_, body) = http_get(&addr, "/metrics").await?;
        body.lines()
            .find(|l| l.starts_with("outbox_relay_published_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
    };
    wait_until(Duration::from_secs(30), "the published counter", || async {
        published_now().await.is_some_and(|n| n >= ids.len() as f64)
    })
    .await;
    let (status, body) = http_get(&addr, "/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200);
    for name in [
        "outbox_relay_published_total",
        "outbox_relay_batch_size",
        "outbox_relay_confirm_seconds",
    ] {
        assert!(body.contains(name), "/metrics lacks {name}:\n{body}");
    }
    let published: f64 = body
        .lines()
        .find(|l| l.starts_with("outbox_relay_published_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .expect("a published counter value");
    assert!(
        published >= ids.len() as f64,
        "published counter {published} < {}",
        ids.len()
    );
    signal(&child, Signal::SIGTERM);
    child.wait().unwrap();
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}
