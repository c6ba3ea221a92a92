//! The fleet (`outbox-relay run --all-schemas`): what idle tenants cost,
//! how soon a new tenant is served, and a backlog spread over many tenants
//! against the same backlog in one schema under a relay of its own. In a
//! database of its own, dropped afterwards.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use lapin::Channel;
use outbox::OrderedAggregates;
use sqlx::{AssertSqlSafe, PgPool};

use crate::common::{
    Stats, connect, cpu_seconds, drop_queue, fill_outbox, peak_rss_mib, queue_depth, suffix,
    time_queue_fill, topology,
};
use crate::relay::{relay_binary, spawn_relay, stop_child};

/// The fleet's default workers (`--workers`): the connection goal is
/// these + 3.
const WORKERS: usize = 2;

/// What the fleet section measures.
pub(crate) struct FleetSizes {
    /// Idle tenants.
    pub(crate) tenants: usize,
    /// Seconds each idle figure is taken over.
    pub(crate) idle_secs: f64,
    /// Seconds waited before it, for the tenants' upkeep to rest (it does
    /// after a minute without work).
    pub(crate) rest_secs: f64,
    /// New tenants timed from migrated to published.
    pub(crate) discoveries: usize,
    /// Tenants with a backlog, events each, rounds of the drain.
    pub(crate) drain: (usize, usize, usize),
    /// Fairness: tenants trickling, each at `rate` events/s, for `secs`,
    /// with no backlog and then beside one tenant's `backlog`.
    pub(crate) fairness: Fairness,
}

/// The fairness run's sizes.
pub(crate) struct Fairness {
    pub(crate) tenants: usize,
    pub(crate) rate: f64,
    pub(crate) secs: f64,
    pub(crate) backlog: usize,
}

/// The fleet section's figures.
pub(crate) struct FleetFigures {
    pub(crate) idle_cpu_pct: f64,
    pub(crate) idle_cpu_metrics_pct: f64,
    pub(crate) idle_connections: i64,
    pub(crate) idle_rss_mib: f64,
    pub(crate) discovery_s: Stats,
    pub(crate) drain_ratio: Stats,
    pub(crate) fleet_rate: Stats,
    pub(crate) single_rate: Stats,
    /// Commit -> received latencies (ms) of the trickling tenants: with no
    /// backlog, and beside one tenant's.
    pub(crate) trickle_clean_ms: Vec<f64>,
    pub(crate) trickle_backlog_ms: Vec<f64>,
    /// Events of the backlog left when its window ended (0: it drained
    /// within the window, which then did not all run beside it).
    pub(crate) backlog_left: i64,
}

/// The database the section runs in: created, dropped by [`Database::drop`].
struct Database {
    name: String,
    url: String,
    pool: PgPool,
}

impl Database {
    async fn create(server: &PgPool, database_url: &str) -> Result<Self> {
        let name = format!("bench_fleet_{}", suffix());
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(server)
            .await?;
        let mut url = url::Url::parse(database_url).context("the database URL")?;
        url.set_path(&name);
        let url = url.to_string();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await?;
        Ok(Self { name, url, pool })
    }

    async fn drop(self, server: &PgPool) -> Result<()> {
        self.pool.close().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            self.name
        )))
        .execute(server)
        .await?;
        Ok(())
    }

    /// The relay's sessions in it now (its pools set this name).
    async fn relay_connections(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'outbox-relay'",
        )
        .bind(&self.name)
        .fetch_one(&self.pool)
        .await?)
    }
}

/// `outbox-relay run --all-schemas` on `db`'s tenants named `like`,
/// publishing to `exchange`, with `args`.
fn spawn_fleet(
    db: &Database,
    url: &str,
    exchange: &str,
    like: &str,
    args: &[&str],
) -> Result<Child> {
    Command::new(relay_binary()?)
        .env("DATABASE_URL", &db.url)
        .env("AMQP_URL", url)
        .env("OUTBOX_EXCHANGE", exchange)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env("OUTBOX_WORKERS", WORKERS.to_string())
        .env("RUST_LOG", "warn")
        .args(["run", "--all-schemas", "--like", like])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .context("starting outbox-relay --all-schemas")
}

/// Migrates `names` in `db`, eight at once.
async fn migrate_all(db: &Database, names: &[String]) -> Result<()> {
    let mut runs = futures_util::stream::iter(names)
        .map(|name| outbox::migrate(&db.pool, name))
        .buffer_unordered(8);
    while let Some(done) = runs.next().await {
        done?;
    }
    Ok(())
}

/// One event into `schema`'s outbox, by the table's contract.
async fn insert_one(pool: &PgPool, schema: &str) -> Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('tenant', '1', 'Joined', '{{}}')"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Waits (at most `limit`) until `queue` holds `n` messages.
async fn wait_depth(ch: &Channel, queue: &str, n: u64, limit: Duration) -> Result<()> {
    let until = Instant::now() + limit;
    loop {
        let depth = queue_depth(ch, queue).await?;
        if depth >= n {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "{queue} holds {depth} of {n} messages after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// CPU % of one core `child` used, the most relay connections seen, over
/// `secs` of idling.
async fn idle_span(db: &Database, child: &Child, secs: f64) -> Result<(f64, i64)> {
    let pid = child.id();
    let start = (Instant::now(), cpu_seconds(None, Some(pid)));
    let mut connections = 0;
    while start.0.elapsed().as_secs_f64() < secs {
        connections = connections.max(db.relay_connections().await?);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let cpu = cpu_seconds(None, Some(pid)) - start.1;
    Ok((100.0 * cpu / start.0.elapsed().as_secs_f64(), connections))
}

pub(crate) async fn fleet(
    server: &PgPool,
    database_url: &str,
    url: &str,
    sizes: &FleetSizes,
) -> Result<FleetFigures> {
    let db = Database::create(server, database_url).await?;
    let done = measure(&db, url, sizes).await;
    db.drop(server).await?;
    done
}

async fn measure(db: &Database, url: &str, sizes: &FleetSizes) -> Result<FleetFigures> {
    let conn = connect(url).await?;
    let name = format!("bench_fleet_{}", suffix());
    topology(&conn, &name).await?;
    let ch = conn.create_channel().await?;
    let tenants: Vec<String> = (0..sizes.tenants)
        .map(|i| format!("tenant_{i:05}"))
        .collect();
    eprintln!("bench:   migrating {} tenant schemas", tenants.len());
    migrate_all(db, &tenants).await?;

    // Idle: every tenant found (an event in the first and in the last one
    // published), then nothing to do.
    let mut published = 0u64;
    let idle = async |args: &[&str], published: &mut u64| -> Result<(f64, i64, f64)> {
        let mut fleet = spawn_fleet(db, url, &name, "tenant\\_%", args)?;
        let warm = async {
            for t in [&tenants[0], &tenants[tenants.len() - 1]] {
                insert_one(&db.pool, t).await?;
            }
            *published += 2;
            wait_depth(&ch, &name, *published, Duration::from_secs(120)).await?;
            // The tenants' upkeep (started by those events) rests after a
            // minute without work: idle is after that.
            tokio::time::sleep(Duration::from_secs_f64(sizes.rest_secs)).await;
            idle_span(db, &fleet, sizes.idle_secs).await
        };
        let measured = warm.await;
        let rss = peak_rss_mib(fleet.id()).unwrap_or(f64::NAN);
        stop_child(&mut fleet)?;
        let (cpu, connections) = measured?;
        Ok((cpu, connections, rss))
    };
    eprintln!("bench:   {} idle tenants", tenants.len());
    let (idle_cpu_pct, idle_connections, idle_rss_mib) = idle(&[], &mut published).await?;
    eprintln!(
        "bench:   idle: {idle_cpu_pct:.2}% of a core, {idle_connections} connections, {idle_rss_mib:.1} MiB"
    );
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let (idle_cpu_metrics_pct, _, _) = idle(&["--metrics-addr", &metrics], &mut published).await?;
    eprintln!("bench:   idle with /metrics: {idle_cpu_metrics_pct:.2}% of a core");

    // A new tenant: from migrated to its first event published.
    let mut discovery_s = Stats::default();
    let mut fleet = spawn_fleet(db, url, &name, "tenant\\_%", &[])?;
    let discovered = async {
        insert_one(&db.pool, &tenants[0]).await?;
        published += 1;
        wait_depth(&ch, &name, published, Duration::from_secs(120)).await?;
        for k in 0..sizes.discoveries {
            let schema = format!("tenant_new_{k}");
            outbox::migrate(&db.pool, &schema).await?;
            let migrated = Instant::now();
            insert_one(&db.pool, &schema).await?;
            published += 1;
            wait_depth(&ch, &name, published, Duration::from_secs(60)).await?;
            let secs = migrated.elapsed().as_secs_f64();
            eprintln!("bench:   tenant {schema} served {secs:.3} s after its migration");
            discovery_s.push(secs);
        }
        anyhow::Ok(())
    };
    let discovered = discovered.await;
    stop_child(&mut fleet)?;
    discovered?;
    drop_queue(&conn, &name).await?;

    // A backlog over many tenants, and the same in one schema.
    let (spread, each, rounds) = sizes.drain;
    let drains: Vec<String> = (0..spread).map(|i| format!("drain_{i:04}")).collect();
    migrate_all(db, &drains).await?;
    let single = "single_tenant".to_owned();
    outbox::migrate(&db.pool, &single).await?;
    let n = (spread * each) as u64;
    let warm = n / 20;
    let (mut fleet_rate, mut single_rate, mut drain_ratio) =
        (Stats::default(), Stats::default(), Stats::default());
    for round in 0..rounds {
        let mut pair = [0.0; 2];
        // ABBA over the rounds: neither side always first.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let queue = format!("bench_fleet_drain_{}", suffix());
            topology(&conn, &queue).await?;
            let mut relay = if side == 0 {
                for d in &drains {
                    fill_outbox(&db.pool, d, each, OrderedAggregates::None, 1_000).await?;
                }
                spawn_fleet(db, url, &queue, "drain\\_%", &[])?
            } else {
                fill_outbox(
                    &db.pool,
                    &single,
                    spread * each,
                    OrderedAggregates::None,
                    1_000,
                )
                .await?;
                spawn_relay(&db.url, url, &single, &queue, None)?
            };
            let timed = time_queue_fill(&ch, &queue, warm, n, Duration::from_secs(60)).await;
            stop_child(&mut relay)?;
            let (from, to) = timed?;
            pair[side] = (n - warm) as f64 / to.duration_since(from).as_secs_f64();
            drop_queue(&conn, &queue).await?;
        }
        eprintln!(
            "bench:   {spread} tenants x {each}: fleet {:.0}/s, one schema {:.0}/s",
            pair[0], pair[1]
        );
        fleet_rate.push(pair[0]);
        single_rate.push(pair[1]);
        drain_ratio.push(pair[0] / pair[1]);
    }
    drop_queue(&conn, &name).await?;

    let (trickle_clean_ms, trickle_backlog_ms, backlog_left) =
        fairness(db, url, &conn, &sizes.fairness).await?;
    Ok(FleetFigures {
        trickle_clean_ms,
        trickle_backlog_ms,
        backlog_left,
        idle_cpu_pct,
        idle_cpu_metrics_pct,
        idle_connections,
        idle_rss_mib,
        discovery_s,
        drain_ratio,
        fleet_rate,
        single_rate,
    })
}

/// Tenants trickling events open-loop (each insert its own task, on a
/// schedule: a slow commit delays no other), timed from their commit's
/// return to their arrival on a queue: first with no backlog anywhere,
/// then while the fleet drains one tenant's backlog. Returns both runs'
/// latencies (ms) and what was left of the backlog when its run ended.
async fn fairness(
    db: &Database,
    url: &str,
    conn: &lapin::Connection,
    f: &Fairness,
) -> Result<(Vec<f64>, Vec<f64>, i64)> {
    let trickles: Vec<String> = (0..f.tenants).map(|i| format!("fair_{i:03}")).collect();
    migrate_all(db, &trickles).await?;
    let heavy = "fair_heavy";
    outbox::migrate(&db.pool, heavy).await?;
    let mut latencies = [Vec::new(), Vec::new()];
    let mut left = 0;
    for (run, backlog) in [false, true].into_iter().enumerate() {
        let exchange = format!("bench_fleet_fair_{}", suffix());
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Topic,
            Default::default(),
            Default::default(),
        )
        .await?;
        // The backlog's events (`order.*`) go to a queue that keeps only
        // the newest (it is measured by its outbox); the trickle's
        // (`tenant.*`) to the queue timed.
        let sink = format!("{exchange}.backlog");
        let mut args = lapin::types::FieldTable::default();
        args.insert(
            "x-max-length".into(),
            lapin::types::AMQPValue::LongInt(1_000),
        );
        let arrivals = format!("{exchange}.trickle");
        for (queue, key, args) in [
            (&sink, "order.#", args),
            (&arrivals, "tenant.#", Default::default()),
        ] {
            ch.queue_declare(queue.as_str().into(), Default::default(), args)
                .await?;
            ch.queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                key.into(),
                Default::default(),
                Default::default(),
            )
            .await?;
        }
        if backlog {
            eprintln!("bench:   filling one tenant with {} events", f.backlog);
            fill_outbox(&db.pool, heavy, f.backlog, OrderedAggregates::None, 1_000).await?;
        }
        let arrived = Arrivals::start(conn, &arrivals).await?;
        let mut fleet = spawn_fleet(db, url, &exchange, "fair\\_%", &[])?;
        let timed = async {
            // Every tenant served once (and the backlog's drain under way)
            // before the clock starts.
            for t in &trickles {
                insert_one(&db.pool, t).await?;
            }
            arrived
                .wait_for(trickles.len(), Duration::from_secs(120))
                .await?;
            let committed = trickle(&db.pool, &trickles, f.rate, f.secs).await?;
            if backlog {
                left = crate::common::outbox_len(&db.pool, heavy).await?;
            }
            arrived
                .wait_for(trickles.len() + committed.len(), Duration::from_secs(120))
                .await?;
            Ok::<_, anyhow::Error>(arrived.latencies_ms(&committed))
        };
        let timed = timed.await;
        stop_child(&mut fleet)?;
        arrived.stop();
        latencies[run] = timed?;
        sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE \"{heavy}\".outbox")))
            .execute(&db.pool)
            .await?;
        for q in [&sink, &arrivals] {
            ch.queue_delete(q.as_str().into(), Default::default())
                .await?;
        }
        ch.exchange_delete(exchange.as_str().into(), Default::default())
            .await?;
        let pct = crate::latency::percentiles("", &latencies[run]);
        eprintln!(
            "bench:   {} tenants at {}/s, {}: p50 {:.1} ms, p99 {:.1} ms ({} events)",
            f.tenants,
            f.rate,
            if backlog {
                format!("one tenant draining {} ({left} left at the end)", f.backlog)
            } else {
                "no backlog".to_owned()
            },
            pct[0].1,
            pct[2].1,
            latencies[run].len()
        );
    }
    let [clean, beside] = latencies;
    Ok((clean, beside, left))
}

/// Commits events into `tenants` in turn, `rate` per tenant per second,
/// for `secs`, each insert a task of its own started on schedule. Returns
/// each event's id and when its commit returned.
async fn trickle(
    pool: &PgPool,
    tenants: &[String],
    rate: f64,
    secs: f64,
) -> Result<Vec<(String, Instant)>> {
    let every = Duration::from_secs_f64(1.0 / (rate * tenants.len() as f64));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    let mut k = 0usize;
    while start.elapsed().as_secs_f64() < secs {
        tokio::time::sleep_until(start + every * k as u32).await;
        let (pool, schema) = (pool.clone(), tenants[k % tenants.len()].clone());
        tasks.push(tokio::spawn(async move {
            let id = uuid::Uuid::now_v7();
            // As the table's contract says a producer wakes the relays:
            // a notification in the event's transaction.
            sqlx::query(AssertSqlSafe(format!(
                "WITH e AS (INSERT INTO \"{schema}\".outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ($1, 'tenant', '1', 'Joined', '{{}}') RETURNING id)
                 SELECT pg_notify($2, '') FROM e"
            )))
            .bind(id)
            .bind(outbox::wakeup_channel(&outbox::Ident::new("schema", &schema)?))
            .execute(&pool)
            .await?;
            anyhow::Ok((id.to_string(), Instant::now()))
        }));
        k += 1;
    }
    let mut committed = Vec::with_capacity(tasks.len());
    for t in tasks {
        committed.push(t.await??);
    }
    Ok(committed)
}

/// A queue's deliveries as they arrive: message id and arrival time.
struct Arrivals {
    seen: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Arrivals {
    async fn start(conn: &lapin::Connection, queue: &str) -> Result<Self> {
        let ch = conn.create_channel().await?;
        let mut deliveries = ch
            .basic_consume(
                queue.into(),
                "fairness".into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await?;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let task = {
            let seen = seen.clone();
            tokio::spawn(async move {
                while let Some(Ok(d)) = deliveries.next().await {
                    let now = Instant::now();
                    if let Some(id) = d.properties.message_id() {
                        crate::common::lock(&seen)
                            .entry(id.to_string())
                            .or_insert(now);
                    }
                }
            })
        };
        Ok(Self { seen, task })
    }

    async fn wait_for(&self, n: usize, limit: Duration) -> Result<()> {
        let until = Instant::now() + limit;
        loop {
            let got = crate::common::lock(&self.seen).len();
            if got >= n {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < until,
                "{got} of {n} trickled events arrived after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Each committed event's wait from its commit to its arrival.
    fn latencies_ms(&self, committed: &[(String, Instant)]) -> Vec<f64> {
        let seen = crate::common::lock(&self.seen);
        committed
            .iter()
            .filter_map(|(id, at)| seen.get(id).map(|got| got.saturating_duration_since(*at)))
            .map(|d| d.as_secs_f64() * 1e3)
            .collect()
    }

    fn stop(self) {
        self.task.abort();
    }
}

/// A loopback port free now.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
