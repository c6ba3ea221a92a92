//! The fleet: one relay process for the tenant schemas of two databases.
//! Every tenant's events published, a tenant that joins found without a
//! restart, a tenant dropped while the others publish.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDatabase, amqp_url, wait_until};
use lapin::types::FieldTable;
use outbox_relay::{Fleet, FleetConfig, RelayConfig};
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `n` events into `schema`'s outbox, by plain SQL (the table's contract):
/// their ids.
async fn insert(pool: &PgPool, schema: &str, n: usize) -> Vec<String> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT id, 'order', id::text, 'OrderPlaced', '{{}}' FROM unnest($1::uuid[]) id"
    )))
    .bind(&ids)
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("insert into {schema}: {e}"));
    ids.iter().map(Uuid::to_string).collect()
}

/// A fleet of `cfg` running: stop it with the token, then join the task.
fn start(
    cfg: FleetConfig,
) -> (
    Fleet,
    CancellationToken,
    tokio::task::JoinHandle<outbox_relay::Result<()>>,
) {
    let fleet = Fleet::new(cfg).unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (fleet, stop) = (fleet.clone(), stop.clone());
        async move { fleet.run(stop).await }
    });
    (fleet, stop, running)
}

fn config(broker: &TestBroker) -> RelayConfig {
    e2e::TestRelay::broker_config(broker)
}

async fn relay_pool(db: &TestDatabase) -> PgPool {
    outbox_relay::pool_options(Duration::from_secs(10))
        .max_connections(4)
        .connect(&db.url)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_fleet_publishes_the_tenants_of_two_databases_finds_new_ones_and_outlives_a_dropped_one()
 {
    let dbs = [
        TestDatabase::create("fleet_a").await,
        TestDatabase::create("fleet_b").await,
    ];
    let broker = TestBroker::new("fleet", FieldTable::default()).await;
    let mut ids = Vec::new();
    for db in &dbs {
        for i in 0..10 {
            let schema = format!("tenant_{i:02}");
            outbox::migrate(&db.pool, &schema).await.unwrap();
            // One tenant with a backlog, the others with a few.
            let n = if i == 0 { 2_000 } else { 20 };
            ids.extend(insert(&db.pool, &schema, n).await);
        }
    }
    // Ordered events in one tenant of each database: they need the
    // tenant's partition leases, taken once it has work.
    for db in &dbs {
        outbox::set_ordered(&db.pool, "tenant_03", "order", true)
            .await
            .unwrap();
        ids.extend(insert(&db.pool, "tenant_03", 50).await);
    }
    // Not a tenant: the pattern leaves it out.
    outbox::migrate(&dbs[0].pool, "other").await.unwrap();
    let left_out = insert(&dbs[0].pool, "other", 5).await;

    let collector = Collector::start(&broker.queue);
    let mut cfg = FleetConfig::new(
        vec![relay_pool(&dbs[0]).await, relay_pool(&dbs[1]).await],
        config(&broker),
    );
    cfg.like = Some("tenant\\_%".to_owned());
    cfg.discover_every = Duration::from_millis(500);
    let (fleet, stop, running) = start(cfg);
    wait_until(
        Duration::from_secs(120),
        "every tenant's events",
        || async { ids.iter().all(|id| collector.has(id)) },
    )
    .await;
    assert_eq!(fleet.tenants().len(), 20, "{:?}", fleet.tenants());

    // A tenant that joins: found by the census, its events published.
    outbox::migrate(&dbs[1].pool, "tenant_new").await.unwrap();
    let joined = insert(&dbs[1].pool, "tenant_new", 10).await;
    wait_until(
        Duration::from_secs(30),
        "the new tenant's events",
        || async { joined.iter().all(|id| collector.has(id)) },
    )
    .await;

    // A tenant dropped while the others publish: they go on.
    sqlx::raw_sql("DROP SCHEMA tenant_05 CASCADE")
        .execute(&dbs[0].pool)
        .await
        .unwrap();
    let mut after = Vec::new();
    for db in &dbs {
        for i in [1, 2, 9] {
            after.extend(insert(&db.pool, &format!("tenant_{i:02}"), 10).await);
        }
    }
    wait_until(
        Duration::from_secs(30),
        "the other tenants' events",
        || async { after.iter().all(|id| collector.has(id)) },
    )
    .await;
    wait_until(
        Duration::from_secs(30),
        "the dropped tenant gone from the fleet",
        || async {
            !fleet
                .tenants()
                .iter()
                .any(|t| t.database == 0 && t.schema == "tenant_05")
        },
    )
    .await;

    stop.cancel();
    running.await.unwrap().expect("a clean stop");
    collector.drain(Duration::from_secs(30)).await;
    let seen: HashSet<String> = collector
        .received
        .lock()
        .unwrap()
        .counts
        .keys()
        .cloned()
        .collect();
    for id in &left_out {
        assert!(
            !seen.contains(id),
            "a schema the pattern leaves out was published"
        );
    }
    for db in dbs {
        db.cleanup().await;
    }
    broker.cleanup().await;
}

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// `outbox-relay run --all-schemas` on `dbs` (the first as DATABASE_URL,
/// the others as --more-database-url) publishing to `broker`, with `args`.
fn fleet_command(
    dbs: &[&TestDatabase],
    broker: &TestBroker,
    args: &[&str],
) -> std::process::Command {
    let mut c = std::process::Command::new(BIN);
    c.env("DATABASE_URL", &dbs[0].url)
        .env("AMQP_URL", amqp_url())
        .env("OUTBOX_EXCHANGE", &broker.exchange)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env("OUTBOX_POLL_INTERVAL", "200ms")
        .env("RUST_LOG", "warn")
        .args(["run", "--all-schemas", "--discover-every", "500ms"])
        .args(args);
    for db in &dbs[1..] {
        c.args(["--more-database-url", &db.url]);
    }
    c
}

/// The value of the series `series` (name and labels, as printed) in a
/// Prometheus text page.
fn series(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn outbox_relay_run_all_schemas_serves_two_databases_and_shows_only_the_worst_tenants() {
    let dbs = [
        TestDatabase::create("fleet_cli_a").await,
        TestDatabase::create("fleet_cli_b").await,
    ];
    let broker = TestBroker::new("fleet_cli", FieldTable::default()).await;
    let mut ids = Vec::new();
    for db in &dbs {
        for i in 0..6 {
            let schema = format!("tenant_{i:02}");
            outbox::migrate(&db.pool, &schema).await.unwrap();
            ids.extend(insert(&db.pool, &schema, 20).await);
        }
    }
    // Backlogs that stay (due in an hour): tenant_02 of the second
    // database the largest, tenant_04 of the first the next.
    for (db, schema, n) in [(&dbs[1], "tenant_02", 7), (&dbs[0], "tenant_04", 3)] {
        let later: Vec<String> = insert(&db.pool, schema, n).await;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE \"{schema}\".outbox SET available_at = now() + interval '1 hour' WHERE id = ANY($1::uuid[])"
        )))
        .bind(
            later
                .iter()
                .map(|i| i.parse::<Uuid>().unwrap())
                .collect::<Vec<_>>(),
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // A tenant an older release migrated: found, not served.
    outbox::testing::migrate_to(&dbs[0].pool, "tenant_old", 5)
        .await
        .unwrap();
    // The fleets' membership table in the first database, alone (nothing
    // else migrated), then up to date: not a tenant (the census leaves
    // it out: the totals below count twelve).
    for said in [
        "outbox_fleet (the fleets' membership): applied migrations [1]",
        "outbox_fleet (the fleets' membership) is up to date",
    ] {
        let (code, text) = e2e::output(
            std::process::Command::new(BIN)
                .env("DATABASE_URL", &dbs[0].url)
                .args(["migrate", "--fleet"]),
        );
        assert_eq!(code, Some(0), "{text}");
        assert!(text.contains(said), "{text}");
        assert!(!text.contains("schema public"), "{text}");
    }

    // The write-ahead-log capture is a relay per schema: refused at once.
    let (code, text) = e2e::output(&mut fleet_command(
        &[&dbs[0]],
        &broker,
        &["--capture", "wal"],
    ));
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("--all-schemas serves the outbox tables only"),
        "{text}"
    );
    assert_eq!(text.trim().lines().count(), 1, "one line: {text}");
    // A database that cannot be reached: named, its password never shown.
    let (code, text) = e2e::output(
        fleet_command(&[&dbs[0]], &broker, &[])
            .args([
                "--more-database-url",
                "postgres://app:s3cr3t-pw@127.0.0.1:1/nowhere",
            ])
            .env("OUTBOX_DATABASE_TIMEOUT", "2s"),
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("database 2"), "{text}");
    assert!(!text.contains("s3cr3t-pw"), "a password printed: {text}");

    let collector = Collector::start(&broker.queue);
    let logs = e2e::ProcessLogs::new("fleet_cli");
    let port = e2e::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = fleet_command(
        &[&dbs[0], &dbs[1]],
        &broker,
        &["--metrics-addr", &addr, "--metrics-tenants", "2"],
    );
    logs.attach(&mut cmd, "fleet");
    let mut child = e2e::KillOnDrop(cmd.spawn().unwrap());
    wait_until(
        Duration::from_secs(60),
        "every tenant's due events",
        || async { ids.iter().all(|id| collector.has(id)) },
    )
    .await;
    let last = std::sync::Mutex::new(String::new());
    wait_until(Duration::from_secs(60), "the tenants' gauges", || async {
        let page = e2e::http_get(&addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        let done = series(&page, "outbox_relay_tenants{state=\"ok\"}") == Some(12.0)
            && series(&page, "outbox_relay_backlog") == Some(10.0);
        *last.lock().unwrap() = page;
        done
    })
    .await;
    let page = last.into_inner().unwrap();
    assert_eq!(
        series(&page, "outbox_relay_tenants{state=\"not_served\"}"),
        Some(1.0),
        "{page}"
    );
    // Only the two worst tenants have series of their own.
    let own: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("outbox_relay_tenant_backlog{"))
        .collect();
    assert_eq!(
        own,
        [
            format!(
                "outbox_relay_tenant_backlog{{database=\"{}\",schema=\"tenant_02\"}} 7",
                dbs[1].name
            ),
            format!(
                "outbox_relay_tenant_backlog{{database=\"{}\",schema=\"tenant_04\"}} 3",
                dbs[0].name
            ),
        ],
        "{page}"
    );
    assert_eq!(
        series(
            &page,
            &format!(
                "outbox_relay_tenant_published_total{{database=\"{}\",schema=\"tenant_02\"}}",
                dbs[1].name
            )
        ),
        Some(20.0),
        "{page}"
    );
    let (status, ready) = e2e::http_get(&addr, "/readyz").await.unwrap();
    assert_eq!(status, 200, "{ready}");

    let code = e2e::stop_child(
        &mut child,
        nix::sys::signal::Signal::SIGTERM,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(code, Some(0), "{}", logs.tails());
    collector.drain(Duration::from_secs(30)).await;
    assert_eq!(
        collector.distinct(),
        ids.len(),
        "the due events, each once, none of those due later"
    );
    for db in dbs {
        db.cleanup().await;
    }
    broker.cleanup().await;
}

#[tokio::test]
async fn a_tenant_migrated_while_the_fleet_runs_is_served_at_once_not_at_the_next_census() {
    let db = TestDatabase::create("fleet_join").await;
    let broker = TestBroker::new("fleet_join", FieldTable::default()).await;
    outbox::migrate(&db.pool, "tenant_a").await.unwrap();
    let first = insert(&db.pool, "tenant_a", 5).await;
    let collector = Collector::start(&broker.queue);
    let mut cfg = FleetConfig::new(vec![relay_pool(&db).await], config(&broker));
    // The census at start, then not for an hour: only the migration's
    // notification can bring the new tenant in.
    cfg.discover_every = Duration::from_secs(3600);
    let (_fleet, stop, running) = start(cfg);
    wait_until(
        Duration::from_secs(30),
        "the first tenant's events",
        || async { first.iter().all(|id| collector.has(id)) },
    )
    .await;
    outbox::migrate(&db.pool, "tenant_b").await.unwrap();
    let joined = insert(&db.pool, "tenant_b", 5).await;
    wait_until(
        Duration::from_secs(30),
        "the new tenant's events",
        || async { joined.iter().all(|id| collector.has(id)) },
    )
    .await;
    stop.cancel();
    running.await.unwrap().expect("a clean stop");
    db.cleanup().await;
    broker.cleanup().await;
}

/// The tenants a fleet serves now.
fn served(fleet: &Fleet) -> HashSet<String> {
    fleet
        .tenants()
        .into_iter()
        .filter(|t| t.served_here)
        .map(|t| t.schema)
        .collect()
}

/// Two fleets over a database whose fleets' table is migrated split its
/// tenants: each serves some, none both, and each publishes only its own
/// tenants' events; when one stops the other takes every tenant.
#[tokio::test]
async fn two_fleets_split_the_tenants_and_one_serves_them_all_once_the_other_stops() {
    let db = TestDatabase::create("fleet_split").await;
    let broker = TestBroker::new("fsplit", FieldTable::default()).await;
    assert_eq!(outbox_relay::migrate_fleet(&db.pool).await.unwrap(), [1]);
    let tenants: Vec<String> = (0..16).map(|i| format!("tenant_{i:02}")).collect();
    for t in &tenants {
        outbox::migrate(&db.pool, t).await.unwrap();
    }
    let collector = Collector::start(&broker.queue);
    let mut fleets = Vec::new();
    for name in ["fleet-a", "fleet-b"] {
        let mut cfg = FleetConfig::new(vec![relay_pool(&db).await], config(&broker));
        cfg.relay.name = name.to_owned();
        // Rounds every 2 s, a heartbeat good for 6 s: a busy machine's
        // late round does not make a live fleet look dead.
        cfg.relay.lease_ttl = Duration::from_secs(6);
        cfg.like = Some("tenant\\_%".to_owned());
        cfg.discover_every = Duration::from_millis(500);
        fleets.push(start(cfg));
    }
    // Each serves some (until they see each other, each serves all), and
    // together all, none twice.
    let split = || {
        let (a, b) = (served(&fleets[0].0), served(&fleets[1].0));
        let split = !a.is_empty()
            && !b.is_empty()
            && a.len() + b.len() == tenants.len()
            && a.is_disjoint(&b);
        (split, format!("{a:?} / {b:?}"))
    };
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !split().0 {
        assert!(
            std::time::Instant::now() < until,
            "the tenants not split after 30 s: {}",
            split().1
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut ids = Vec::new();
    for t in &tenants {
        ids.extend(insert(&db.pool, t, 20).await);
    }
    wait_until(Duration::from_secs(60), "every tenant's events", || async {
        ids.iter().all(|id| collector.has(id))
    })
    .await;
    for (fleet, _, _) in &fleets {
        for t in fleet.tenants() {
            assert!(
                t.served_here || t.published == 0,
                "{} published by a fleet that does not serve it",
                t.schema
            );
        }
    }

    // One stops (and leaves): the other serves every tenant.
    let (_, stop, running) = fleets.remove(0);
    stop.cancel();
    running.await.unwrap().unwrap();
    let stopped = std::time::Instant::now();
    let (other, stop, running) = fleets.remove(0);
    wait_until(Duration::from_secs(30), "one fleet serving all", || async {
        served(&other).len() == tenants.len()
    })
    .await;
    eprintln!(
        "the other fleet served every tenant {:?} after the stop",
        stopped.elapsed()
    );
    let mut after = Vec::new();
    for t in &tenants {
        after.extend(insert(&db.pool, t, 5).await);
    }
    wait_until(
        Duration::from_secs(60),
        "the events after the stop",
        || async { after.iter().all(|id| collector.has(id)) },
    )
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    db.cleanup().await;
    broker.cleanup().await;
}
