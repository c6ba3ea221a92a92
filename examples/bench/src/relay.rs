//! The relay's drain: the binary against the raw ceiling, cost growth with
//! the backlog, one relay against two, ordered mode. Progress is read from
//! the broker's queue depth, never from the outbox.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use lapin::{Channel, Connection};
use outbox::OrderedAggregates;
use outbox_relay::{Relay, RelayConfig};
use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// Nothing reached the queue for this long: the drain is broken.
const STALL: Duration = Duration::from_secs(60);

/// The relay's default settings on `schema`, publishing to `exchange`
/// (declared by the bench), with the log's capture when the bench runs it.
pub(crate) fn relay_config(url: &str, schema: &str, exchange: &str) -> RelayConfig {
    let mut c = RelayConfig::default();
    c.amqp_url = url.to_owned().into();
    c.schema = schema.to_owned();
    c.default_exchange = exchange.to_owned();
    c.declare_exchange = None;
    if capture() == outbox::Capture::Wal {
        let url = DATABASE_URL.get().cloned().unwrap_or_default();
        c.wal = Some(outbox_relay::WalCapture::new(url));
    }
    c
}

/// A fresh outbox schema and exchange + queue, with a filled backlog.
pub(crate) struct Backlog {
    pub(crate) schema: String,
    pub(crate) name: String,
    conn: Connection,
    pub(crate) ch: Channel,
}

impl Backlog {
    pub(crate) async fn new(
        pool: &PgPool,
        url: &str,
        n: usize,
        ordering: OrderedAggregates,
        aggregates: usize,
    ) -> Result<Self> {
        let schema = fresh_schema(pool, "drain").await?;
        let conn = connect(url).await?;
        let name = format!("bench.drain.{}", suffix());
        topology(&conn, &name).await?;
        fill_outbox(pool, &schema, n, ordering, aggregates).await?;
        let ch = conn.create_channel().await?;
        Ok(Self {
            schema,
            name,
            conn,
            ch,
        })
    }

    pub(crate) async fn depth(&self) -> Result<u64> {
        queue_depth(&self.ch, &self.name).await
    }

    /// Seconds between the queue holding `from` and `to` messages.
    pub(crate) async fn time_fill(&self, from: u64, to: u64) -> Result<f64> {
        let (a, b) = time_queue_fill(&self.ch, &self.name, from, to, STALL).await?;
        Ok(b.duration_since(a).as_secs_f64())
    }

    /// Waits for the outbox to empty (the relays still running), then
    /// checks that exactly `n` messages were published.
    pub(crate) async fn verify(&self, pool: &PgPool, n: u64) -> Result<()> {
        wait_outbox_empty(pool, &self.schema, STALL).await?;
        let depth = self.depth().await?;
        anyhow::ensure!(depth == n, "{depth} messages published for {n} events");
        Ok(())
    }

    /// Drops the queue, exchange and schema (after the relays stopped).
    pub(crate) async fn drop(self, pool: &PgPool) -> Result<()> {
        drop_queue(&self.conn, &self.name).await?;
        drop_schema(pool, &self.schema).await?;
        let _ = self.conn.close(200, "done".into()).await;
        Ok(())
    }
}

/// `count` in-process relays with default settings on `backlog`.
pub(crate) struct Relays {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<outbox_relay::Result<()>>>,
}

impl Relays {
    pub(crate) async fn start(
        pool: &PgPool,
        url: &str,
        backlog: &Backlog,
        count: usize,
    ) -> Result<Self> {
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for _ in 0..count {
            let relay_pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect_with((*pool.connect_options()).clone())
                .await?;
            let relay = Relay::new(
                relay_pool,
                relay_config(url, &backlog.schema, &backlog.name),
            )
            .await?;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move { relay.run(stop).await }));
        }
        Ok(Self { stop, tasks })
    }

    pub(crate) async fn stop(self) -> Result<()> {
        self.stop.cancel();
        for t in self.tasks {
            t.await??;
        }
        Ok(())
    }
}

/// Drains a backlog of `n` events (over `aggregates` aggregates) with
/// `relays` in-process relays; events/s between 5% and 100% of `n`
/// published (the start-up is not timed); checks the counts.
pub(crate) async fn drain_rate(
    pool: &PgPool,
    url: &str,
    n: usize,
    relays: usize,
    ordering: OrderedAggregates,
    aggregates: usize,
) -> Result<f64> {
    let backlog = Backlog::new(pool, url, n, ordering, aggregates).await?;
    let warm = (n / 20) as u64;
    let relays = Relays::start(pool, url, &backlog, relays).await?;
    let secs = backlog.time_fill(warm, n as u64).await;
    let verified = backlog.verify(pool, n as u64).await;
    relays.stop().await?;
    let secs = secs?;
    verified?;
    backlog.drop(pool).await?;
    Ok((n as u64 - warm) as f64 / secs)
}

/// Drain rates with a small and a large backlog, and one relay against two
/// on the same large backlog.
pub(crate) struct Growth {
    pub(crate) small: Stats,
    pub(crate) big_one: Stats,
    pub(crate) big_two: Stats,
}

/// Small backlog: `runs` fresh backlogs of `small`, the first 10% not
/// timed. Large backlog: one backlog of `big`, drained in windows of
/// `window` events (each after `window / 20` untimed), alternating one
/// relay and two: 1, 2, 1, 2, ... (`2 * runs - 1` windows, or fewer if the
/// backlog runs out).
pub(crate) async fn growth(
    pool: &PgPool,
    url: &str,
    small: usize,
    big: usize,
    window: usize,
    runs: usize,
) -> Result<Growth> {
    let mut out = Growth {
        small: Stats::default(),
        big_one: Stats::default(),
        big_two: Stats::default(),
    };
    for run in 0..runs {
        eprintln!("bench:   backlog {small}, run {}", run + 1);
        out.small
            .push(drain_rate(pool, url, small, 1, OrderedAggregates::None, 1_000).await?);
    }
    eprintln!("bench:   filling a backlog of {big}");
    let backlog = Backlog::new(pool, url, big, OrderedAggregates::None, 1_000).await?;
    let warm = (window / 20) as u64;
    let windows = (2 * runs - 1).min(big / (window + window / 20 + 1_000));
    for w in 0..windows {
        let count = 1 + w % 2;
        let base = backlog.depth().await?;
        let relays = Relays::start(pool, url, &backlog, count).await?;
        let secs = backlog
            .time_fill(base + warm, base + warm + window as u64)
            .await?;
        relays.stop().await?;
        let rate = window as f64 / secs;
        eprintln!(
            "bench:   backlog {big}, window {}: {count} relay(s) {rate:.0}/s",
            w + 1
        );
        if count == 1 {
            out.big_one.push(rate);
        } else {
            out.big_two.push(rate);
        }
    }
    // The rest of the backlog goes out too, so the count check covers it.
    let relays = Relays::start(pool, url, &backlog, 2).await?;
    let drained = backlog.time_fill(0, big as u64).await;
    let verified = backlog.verify(pool, big as u64).await;
    relays.stop().await?;
    drained?;
    verified?;
    backlog.drop(pool).await?;
    Ok(out)
}

/// The WAL capture's cost growth: `runs` fresh backlogs of `small` in the
/// log, the first 5% not timed; then one backlog of `big`, read by one
/// relay (a slot has one reader) in `runs` consecutive windows of
/// `window` events after `window / 20` untimed.
pub(crate) async fn wal_growth(
    pool: &PgPool,
    url: &str,
    small: usize,
    big: usize,
    window: usize,
    runs: usize,
) -> Result<Growth> {
    let mut out = Growth {
        small: Stats::default(),
        big_one: Stats::default(),
        big_two: Stats::default(),
    };
    for run in 0..runs {
        eprintln!("bench:   WAL backlog {small}, run {}", run + 1);
        out.small
            .push(drain_rate(pool, url, small, 1, OrderedAggregates::None, 1_000).await?);
    }
    eprintln!("bench:   filling a WAL backlog of {big}");
    let backlog = Backlog::new(pool, url, big, OrderedAggregates::None, 1_000).await?;
    let warm = (window / 20) as u64;
    let windows = runs.min(big.saturating_sub(warm as usize) / window.max(1));
    let relays = Relays::start(pool, url, &backlog, 1).await?;
    for w in 0..windows {
        let from = warm + (w * window) as u64;
        let secs = backlog.time_fill(from, from + window as u64).await?;
        let rate = window as f64 / secs;
        eprintln!("bench:   WAL backlog {big}, window {}: {rate:.0}/s", w + 1);
        out.big_one.push(rate);
    }
    let drained = backlog.time_fill(0, big as u64).await;
    let verified = backlog.verify(pool, big as u64).await;
    relays.stop().await?;
    drained?;
    verified?;
    backlog.drop(pool).await?;
    Ok(out)
}

/// One run of the `outbox-relay` binary (default settings) draining a
/// backlog of `n`: events/s between 5% and 100% of `n` published, peak
/// RSS MiB, CPU seconds of broker, database and relay over the same span.
pub(crate) async fn drain_process(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
) -> Result<(f64, f64, (f64, f64, f64))> {
    let backlog = Backlog::new(pool, url, n, OrderedAggregates::None, 1_000).await?;
    let mut child = spawn_relay(database_url, url, &backlog.schema, &backlog.name, None)?;
    let cpu = CpuSpan::start(child.id());
    let warm = (n / 20) as u64;
    let timed = backlog.time_fill(warm, n as u64).await;
    let cpu = cpu.stop();
    let rss = peak_rss_mib(child.id()).unwrap_or(f64::NAN);
    let verified = backlog.verify(pool, n as u64).await;
    stop_child(&mut child)?;
    let secs = timed?;
    verified?;
    backlog.drop(pool).await?;
    Ok(((n as u64 - warm) as f64 / secs, rss, cpu))
}

/// The release `outbox-relay` binary beside this one, on `schema`,
/// publishing to `exchange`; with `stage_trace`, its log goes to that file
/// as JSON lines, with its batches' stages traced (`--latency-stages`).
pub(crate) fn spawn_relay(
    database_url: &str,
    url: &str,
    schema: &str,
    exchange: &str,
    stage_trace: Option<&std::path::Path>,
) -> Result<Child> {
    let mut relay = Command::new(relay_binary()?);
    relay
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", url)
        .env("OUTBOX_SCHEMA", schema)
        .env("OUTBOX_EXCHANGE", exchange)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env(
            "OUTBOX_CAPTURE",
            if capture() == outbox::Capture::Wal {
                "wal"
            } else {
                "table"
            },
        )
        .env("RUST_LOG", "warn")
        .arg("run")
        .stdout(Stdio::null());
    if let Some(path) = stage_trace {
        // Its batches' stages as JSON lines, its warnings among them.
        relay
            .env("RUST_LOG", "warn,outbox_relay::stages=trace")
            .env("OUTBOX_LOG_FORMAT", "json")
            .stderr(std::fs::File::create(path)?);
    }
    relay.spawn().context("starting outbox-relay")
}

/// The `outbox-relay` binary beside this one (same profile).
pub(crate) fn relay_binary() -> Result<std::path::PathBuf> {
    let bin = std::env::current_exe()?.with_file_name("outbox-relay");
    anyhow::ensure!(
        bin.exists(),
        "{} missing: build it with `cargo build --release -p outbox-relay-ops`",
        bin.display()
    );
    Ok(bin)
}

/// SIGTERM, then wait (the relay finishes its batch and exits); after
/// 60 s, SIGKILL and an error, so a relay that does not stop cannot hang
/// the bench.
pub(crate) fn stop_child(child: &mut Child) -> Result<()> {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait()?.is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            child.wait()?;
            anyhow::bail!("the relay did not stop within 60 s of SIGTERM; killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Rounds of a backlog of `n` inserted through the table contract (or, with
/// the log's capture, the log) into one schema, each drained by the relay
/// binary started for it (events/s between 5% and 100% published, as
/// [`drain_process`]); with `hold`, one `REPEATABLE READ` transaction in
/// the same database holds its snapshot from before the first round to the
/// end, so no vacuum may remove a published event's row. Returns each
/// round's rate and the outbox's size on disk after the last (bytes).
pub(crate) async fn horizon_rounds(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
    rounds: usize,
    ordering: OrderedAggregates,
    hold: bool,
) -> Result<(Vec<f64>, i64, i64)> {
    let schema = fresh_schema(pool, "horizon").await?;
    let conn = connect(url).await?;
    let name = format!("bench.horizon.{}", suffix());
    topology(&conn, &name).await?;
    let ch = conn.create_channel().await?;
    let held = if hold {
        Some(hold_snapshot(database_url).await?)
    } else {
        None
    };
    let mut rates = Vec::new();
    for round in 0..rounds {
        ch.queue_purge(name.as_str().into(), Default::default())
            .await?;
        // Ordered events: 1,000 aggregates, their sequences going on from
        // round to round.
        fill_outbox(pool, &schema, n, ordering.clone(), 1_000).await?;
        let mut child = spawn_relay(database_url, url, &schema, &name, None)?;
        let warm = (n / 20) as u64;
        let timed = time_queue_fill(&ch, &name, warm, n as u64, STALL).await;
        let emptied = wait_outbox_empty(pool, &schema, STALL).await;
        stop_child(&mut child)?;
        let (a, b) = timed?;
        emptied?;
        let rate = (n as u64 - warm) as f64 / b.duration_since(a).as_secs_f64();
        eprintln!(
            "bench:   horizon {}: round {}: {rate:.0} events/s",
            if hold { "held" } else { "clean" },
            round + 1
        );
        rates.push(rate);
    }
    let size = AssertSqlSafe(format!(
        "SELECT pg_total_relation_size('\"{schema}\".outbox')"
    ))
    .into_sql_str();
    let bytes: i64 = sqlx::query_scalar(size.clone()).fetch_one(pool).await?;
    // Released: what the outbox comes back to within a minute, with no
    // VACUUM FULL (autovacuum and the relay's own traffic only).
    let mut after = bytes;
    if let Some(c) = held {
        release_snapshot(c).await?;
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_secs(2)).await;
            after = sqlx::query_scalar(size.clone()).fetch_one(pool).await?;
        }
    }
    drop_queue(&conn, &name).await?;
    drop_schema(pool, &schema).await?;
    let _ = conn.close(200, "done".into()).await;
    Ok((rates, bytes, after))
}
