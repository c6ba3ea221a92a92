//! The fault oracle over a fleet: two `outbox-relay run --all-schemas`
//! processes serving 24 tenants in two databases while producers write to
//! every tenant (splitting the first database's tenants between them),
//! one relay SIGKILLed and started again, a tenant's schema
//! dropped and recreated, a tenant's grant revoked for a while and
//! restored, one database down for a while (every connection reset).
//! Judged once all
//! is quiet: nothing committed is lost, nothing
//! is published that was not committed, each ordered aggregate's events
//! first arrive in commit order, and publishing never paused for long.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::{
    Collector, KillOnDrop, Mode, ProcessLogs, Proxy, SeqLog, TestBroker, TestDatabase, amqp_url,
    declare_tap_queue, suffix, wait_until,
};
use lapin::types::FieldTable;
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Tenants per database.
const TENANTS: usize = 12;

/// The tenant of each database whose events are ordered.
const ORDERED: &str = "tenant_03";

/// How long the oracle waits for anything.
const DEADLINE: Duration = Duration::from_secs(120);

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// What the relays' role may do in `schema` (docs/OPERATIONS.md, "Least
/// privilege", for a relay).
fn grants(schema: &str, role: &str) -> String {
    format!(
        "GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\";
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" TO \"{role}\";
         GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA \"{schema}\" TO \"{role}\";"
    )
}

/// One committed event: where, and (ordered ones) its aggregate.
#[derive(Debug, Clone)]
struct Written {
    id: String,
    database: usize,
    schema: String,
    /// Written into a schema that was dropped afterwards: it may be gone.
    doomed: bool,
}

/// The producers: one task per database writing one event at a time to
/// its tenants in turn, recording each one committed.
struct Producers {
    written: Arc<Mutex<Vec<Written>>>,
    /// Schemas not written to now (dropped, being recreated).
    paused: Arc<Mutex<HashSet<(usize, String)>>>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Producers {
    fn start(pools: Vec<PgPool>) -> Self {
        let written = Arc::new(Mutex::new(Vec::new()));
        let paused = Arc::new(Mutex::new(HashSet::new()));
        let stop = CancellationToken::new();
        let tasks = pools
            .into_iter()
            .enumerate()
            .map(|(database, pool)| {
                let (written, paused, stop) = (written.clone(), paused.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0usize;
                    while !stop.is_cancelled() {
                        let schema = format!("tenant_{:02}", n % TENANTS);
                        n += 1;
                        if e2e_lock(&paused).contains(&(database, schema.clone())) {
                            continue;
                        }
                        let id = Uuid::now_v7();
                        // Ordered: four aggregates, named per database.
                        let aggregate = format!("d{database}-o-{}", n % 4);
                        let done = sqlx::query(AssertSqlSafe(format!(
                            "INSERT INTO \"{schema}\".outbox (id, aggregate_type, aggregate_id, event_type, payload)
                             VALUES ($1, 'order', $2, 'OrderPlaced', '{{}}')"
                        )))
                        .bind(id)
                        .bind(&aggregate)
                        .execute(&pool)
                        .await;
                        if done.is_ok() {
                            // Dropped meanwhile (paused before the drop):
                            // as doomed as what `doom` marked.
                            let mut w = e2e_lock(&written);
                            let doomed = e2e_lock(&paused).contains(&(database, schema.clone()));
                            w.push(Written {
                                id: id.to_string(),
                                database,
                                schema,
                                doomed,
                            });
                        }
                        tokio::time::sleep(Duration::from_millis(4)).await;
                    }
                })
            })
            .collect();
        Self {
            written,
            paused,
            stop,
            tasks,
        }
    }

    /// Stops writing to `schema` of `database`, and marks what was written
    /// to it as possibly gone.
    fn doom(&self, database: usize, schema: &str) {
        // The same lock order as the producers'.
        let mut written = e2e_lock(&self.written);
        e2e_lock(&self.paused).insert((database, schema.to_owned()));
        for w in written.iter_mut() {
            if w.database == database && w.schema == schema {
                w.doomed = true;
            }
        }
    }

    fn resume(&self, database: usize, schema: &str) {
        e2e_lock(&self.paused).remove(&(database, schema.to_owned()));
    }

    async fn stop(self) -> Vec<Written> {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(self.written).unwrap().into_inner().unwrap()
    }
}

fn e2e_lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fleet process over both databases as `role`.
fn fleet(urls: &[String], broker: &TestBroker, logs: &ProcessLogs, what: &str) -> KillOnDrop {
    let mut c = std::process::Command::new(BIN);
    c.env("DATABASE_URL", &urls[0])
        .env("OUTBOX_MORE_DATABASE_URLS", urls[1..].join(","))
        .env("AMQP_URL", amqp_url())
        .env("OUTBOX_EXCHANGE", &broker.exchange)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env("OUTBOX_POLL_INTERVAL", "200ms")
        .env("OUTBOX_LEASE_TTL", "3s")
        .env("OUTBOX_RETRY_BASE", "100ms")
        .env("OUTBOX_RETRY_MAX", "1s")
        .env("OUTBOX_DATABASE_TIMEOUT", "3s")
        .env("RUST_LOG", "warn")
        .args([
            "run",
            "--all-schemas",
            "--like",
            "tenant\\_%",
            "--discover-every",
            "1s",
            "--name",
            what,
        ]);
    logs.attach(&mut c, what);
    KillOnDrop(c.spawn().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleet_of_two_relays_loses_nothing_through_a_kill_a_dropped_schema_a_revoked_grant_and_a_database_down()
 {
    let dbs = [
        TestDatabase::create("ffault_a").await,
        TestDatabase::create("ffault_b").await,
    ];
    let broker = TestBroker::new("ffault", FieldTable::default()).await;
    let seq_queue = format!("{}.seq", broker.queue);
    let conn = e2e::connect().await;
    declare_tap_queue(
        &conn,
        &broker.exchange,
        &seq_queue,
        "#",
        FieldTable::default(),
    )
    .await;
    let role = format!("t_reader_{}", suffix());
    exec(&dbs[0].pool, &format!("CREATE ROLE \"{role}\" LOGIN")).await;
    // The first database's fleets split its tenants (the SIGKILLed one's
    // share goes to the other when its heartbeat lapses); the second's
    // has no fleets' table: each fleet serves every tenant.
    outbox_relay::migrate_fleet(&dbs[0].pool).await.unwrap();
    exec(&dbs[0].pool, &grants(outbox_relay::FLEET_SCHEMA, &role)).await;
    let mut urls = Vec::new();
    for db in &dbs {
        for i in 0..TENANTS {
            let schema = format!("tenant_{i:02}");
            outbox::migrate(&db.pool, &schema).await.unwrap();
            exec(&db.pool, &grants(&schema, &role)).await;
        }
        outbox::set_ordered(&db.pool, ORDERED, "order", true)
            .await
            .unwrap();
        let mut url = url::Url::parse(&db.url).unwrap();
        url.set_username(&role).unwrap();
        urls.push(url.to_string());
    }
    // The relays reach the second database through a proxy that can take
    // it away (the producers write to it directly).
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    urls[1] = proxy.url(&urls[1]);

    let collector = Collector::start(&broker.queue);
    let seqs = SeqLog::start(&seq_queue);
    let logs = ProcessLogs::new("fleet_faults");
    let mut first = fleet(&urls, &broker, &logs, "fleet-1");
    let mut second = fleet(&urls, &broker, &logs, "fleet-2");
    let producers = Producers::start(dbs.iter().map(|d| d.pool.clone()).collect());
    let started = Instant::now();
    // When each fault began, to say where a long pause fell.
    let mut faults: Vec<(&str, Instant)> = Vec::new();
    let grows = |by: usize, what: &'static str| {
        let target = collector.distinct() + by;
        let collector = &collector;
        async move {
            wait_until(DEADLINE, what, || async { collector.distinct() >= target }).await;
        }
    };
    grows(500, "publishing under way").await;

    // A relay killed mid-stream: the other one goes on; a new one takes
    // its place.
    faults.push(("SIGKILL", Instant::now()));
    first.kill().unwrap();
    first.wait().unwrap();
    grows(500, "the other relay publishing alone").await;
    first = fleet(&urls, &broker, &logs, "fleet-1b");

    // A tenant's schema dropped while it is written to, then recreated.
    faults.push(("drop", Instant::now()));
    producers.doom(0, "tenant_05");
    exec(&dbs[0].pool, "DROP SCHEMA tenant_05 CASCADE").await;
    grows(300, "the others publishing after the drop").await;
    outbox::migrate(&dbs[0].pool, "tenant_05").await.unwrap();
    exec(&dbs[0].pool, &grants("tenant_05", &role)).await;
    producers.resume(0, "tenant_05");

    // A tenant's grant revoked for a while: the others go on meanwhile.
    faults.push(("revoke", Instant::now()));
    exec(
        &dbs[1].pool,
        &format!("REVOKE USAGE ON SCHEMA tenant_07 FROM \"{role}\""),
    )
    .await;
    let revoked = Instant::now();
    grows(1_000, "the others publishing while a grant is revoked").await;
    wait_until(DEADLINE, "ten seconds of a revoked grant", || async {
        revoked.elapsed() >= Duration::from_secs(10)
    })
    .await;
    exec(
        &dbs[1].pool,
        &format!("GRANT USAGE ON SCHEMA tenant_07 TO \"{role}\""),
    )
    .await;
    grows(500, "publishing after the grant is back").await;

    // The second database down for ten seconds at least (every
    // connection reset, new ones refused), then back. The first one's
    // tenants go on meanwhile. (A link gone silent whose old connections
    // stay dead is not here yet: its database timeouts mark every pool's
    // connections suspect, the first database's too, and under load the
    // fleet paused for 24 s: see docs/OPERATIONS.md, "Many tenants".)
    let outage = Instant::now();
    faults.push(("the second database down", outage));
    proxy.set(Mode::Reset);
    grows(
        500,
        "the first database publishing while the second is down",
    )
    .await;
    wait_until(DEADLINE, "ten seconds of it", || async {
        outage.elapsed() >= Duration::from_secs(10)
    })
    .await;
    proxy.set(Mode::Pass);
    grows(500, "publishing after it is back").await;
    let healed = Instant::now();

    let written = producers.stop().await;
    let must: Vec<&Written> = written.iter().filter(|w| !w.doomed).collect();
    // Every event that must arrive (the oracle below says which did not).
    let until = Instant::now() + DEADLINE;
    while Instant::now() < until && !must.iter().all(|w| collector.has(&w.id)) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let quiet = Instant::now();
    for (child, what) in [(&mut first, "fleet-1b"), (&mut second, "fleet-2")] {
        let code = e2e::stop_child(
            child,
            nix::sys::signal::Signal::SIGTERM,
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(
            code,
            Some(0),
            "{what} did not stop cleanly: {}",
            logs.tails()
        );
    }
    collector.drain(Duration::from_secs(30)).await;
    seqs.drain(Duration::from_secs(30)).await;

    // The oracle.
    let known: HashSet<&str> = written.iter().map(|w| w.id.as_str()).collect();
    {
        let got = collector.received.lock().unwrap();
        let lost: Vec<&str> = must
            .iter()
            .filter(|w| !got.counts.contains_key(&w.id))
            .map(|w| w.id.as_str())
            .collect();
        let mut where_lost: HashMap<(usize, &str), usize> = HashMap::new();
        for w in must.iter().filter(|w| !got.counts.contains_key(&w.id)) {
            *where_lost
                .entry((w.database, w.schema.as_str()))
                .or_default() += 1;
        }
        // Where the first lost one of each schema stands among its writes.
        let mut first_lost: HashMap<(usize, &str), (usize, usize)> = HashMap::new();
        for w in &must {
            let e = first_lost
                .entry((w.database, w.schema.as_str()))
                .or_insert((usize::MAX, 0));
            if !got.counts.contains_key(&w.id) && e.0 == usize::MAX {
                e.0 = e.1;
            }
            e.1 += 1;
        }
        first_lost.retain(|_, v| v.0 != usize::MAX);
        assert!(
            lost.is_empty(),
            "{} lost, by (database, schema): {where_lost:?}, the first lost of each at (index, of): {first_lost:?}; {}",
            lost.len(),
            logs.tails()
        );
        let phantom: Vec<&String> = got
            .counts
            .keys()
            .filter(|id| !known.contains(id.as_str()))
            .collect();
        assert!(
            phantom.is_empty(),
            "published, never committed: {phantom:?}"
        );
        // Each ordered aggregate's events first arrive in commit order.
        let mut next: HashMap<String, i64> = HashMap::new();
        let mut ordered = 0;
        for (aggregate, seq) in seqs.entries() {
            if seq == 0 {
                continue;
            }
            let expected = next.entry(aggregate.clone()).or_insert(1);
            if seq == *expected {
                *expected += 1;
                ordered += 1;
            } else {
                assert!(
                    seq < *expected,
                    "{aggregate}: seq {seq} arrived before {expected}"
                );
            }
        }
        assert!(ordered > 20, "only {ordered} ordered events seen");
        // Publishing never paused for long: not through the kill, the drop or
        // the revoked grant.
        let gap = got.longest_gap(started, quiet);
        // Where it ended, against when each fault began.
        let ended = got
            .arrivals
            .windows(2)
            .find(|w| w[0] >= started && w[1] <= quiet && w[1] - w[0] == gap)
            .map(|w| w[1] - started);
        let when: Vec<String> = faults
            .iter()
            .map(|(what, at)| format!("{what} at {:?}", *at - started))
            .collect();
        assert!(
            gap < Duration::from_secs(20),
            "publishing paused for {gap:?}, ending {ended:?} after the start; {when:?}; {}",
            logs.tails()
        );
        // While the second database was away, the first one's tenants
        // paused at most for one database timeout (3 s) of a worker caught
        // on it, and the time the load adds.
        let away = got.longest_gap(outage, healed);
        assert!(
            away < Duration::from_secs(10),
            "publishing paused for {away:?} while the second database was away"
        );
        eprintln!(
            "{} committed ({} in the dropped schema, {} of them published), {} duplicates, {ordered} ordered, longest pause {gap:?}, {away:?} while a database was away",
            written.len(),
            written.len() - must.len(),
            written
                .iter()
                .filter(|w| w.doomed && got.counts.contains_key(&w.id))
                .count(),
            got.duplicates()
        );
    }
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(seq_queue.as_str().into(), Default::default())
        .await;
    for db in dbs {
        db.cleanup().await;
    }
    broker.cleanup().await;
    let server = PgPool::connect(&e2e::database_url()).await.unwrap();
    exec(&server, &format!("DROP ROLE IF EXISTS \"{role}\"")).await;
}
