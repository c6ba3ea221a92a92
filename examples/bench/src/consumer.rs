//! The consumer: the library (batch and per-event handlers) against a raw
//! ack-only consumer and a hand-written batched dedup loop. Every
//! contender runs in spawned tasks, reads the same preloaded persistent
//! messages (the relay's properties) and is timed by the same monitor; the
//! baselines' tunings are swept first and the best one is measured.

use std::fmt;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use outbox_consumer::{
    BatchHandler, BatchOutcome, Consumer, ConsumerConfig, Event, Handler, Outcome,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::publish::{PublishTuning, publish};

/// Nothing consumed for this long: the contender is broken.
const STALL: Duration = Duration::from_secs(30);

/// Raw ack-only consumer: `prefetch` unacked, one multiple ack every
/// `ack_every` deliveries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawTuning {
    prefetch: u16,
    ack_every: usize,
}

/// Hand-written dedup loop: up to `batch` deliveries or `linger_ms`, then
/// the inbox insert and the effect (as two statements in BEGIN/COMMIT, or
/// as one statement that commits on its own), then one multiple ack;
/// `loops` such loops, each on its own channel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HandTuning {
    prefetch: u16,
    batch: usize,
    linger_ms: u64,
    one_statement: bool,
    loops: usize,
}

impl fmt::Display for RawTuning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "prefetch {}, multiple ack every {}",
            self.prefetch, self.ack_every
        )
    }
}

impl fmt::Display for HandTuning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} loop(s), prefetch {}, batch {}, linger {} ms, {}",
            self.loops,
            self.prefetch,
            self.batch,
            self.linger_ms,
            if self.one_statement {
                "one statement (inbox CTE + update, autocommit)"
            } else {
                "BEGIN, inbox insert, update, COMMIT"
            }
        )
    }
}

impl fmt::Display for Contender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Contender::Raw(t) => write!(f, "raw ack-only ({t})"),
            Contender::Hand(t) => write!(f, "hand-written ({t})"),
            Contender::LibraryBatch => f.write_str("library, batch handler"),
            Contender::LibraryTuned(t) => write!(
                f,
                "library, batch handler, prefetch {}, batch {}, linger {} ms",
                t.prefetch, t.batch, t.linger_ms
            ),
            Contender::LibraryPerEvent => f.write_str("library, per-event handler"),
        }
    }
}

const RAW_SWEEP: [RawTuning; 3] = [
    RawTuning {
        prefetch: 256,
        ack_every: 64,
    },
    RawTuning {
        prefetch: 1024,
        ack_every: 256,
    },
    RawTuning {
        prefetch: 2048,
        ack_every: 512,
    },
];

const HAND_SWEEP: [HandTuning; 6] = [
    // The library's defaults, by hand.
    HandTuning {
        prefetch: 256,
        batch: 128,
        linger_ms: 2,
        one_statement: false,
        loops: 1,
    },
    // The old harness's loop.
    HandTuning {
        prefetch: 256,
        batch: 128,
        linger_ms: 20,
        one_statement: false,
        loops: 1,
    },
    HandTuning {
        prefetch: 512,
        batch: 256,
        linger_ms: 2,
        one_statement: false,
        loops: 1,
    },
    HandTuning {
        prefetch: 256,
        batch: 128,
        linger_ms: 2,
        one_statement: true,
        loops: 1,
    },
    HandTuning {
        prefetch: 1024,
        batch: 512,
        linger_ms: 5,
        one_statement: true,
        loops: 1,
    },
    HandTuning {
        prefetch: 512,
        batch: 256,
        linger_ms: 2,
        one_statement: true,
        loops: 2,
    },
];

#[derive(Debug, Clone, Copy)]
enum Contender {
    Raw(RawTuning),
    Hand(HandTuning),
    LibraryBatch,
    /// The batch handler with the hand-written loop's prefetch, batch
    /// size and linger (the code's own price, tuning aside).
    LibraryTuned(HandTuning),
    LibraryPerEvent,
}

/// Results of the consumer measurements: rates per run, each baseline's
/// winning tuning.
pub(crate) struct ConsumerResults {
    pub(crate) raw: Stats,
    pub(crate) hand: Stats,
    pub(crate) batch: Stats,
    pub(crate) per_event: Stats,
    /// Library batch handler / raw ack-only, per round.
    pub(crate) batch_vs_raw: Stats,
    /// Library batch handler / hand-written loop, per round.
    pub(crate) batch_vs_hand: Stats,
    /// The library with the hand-written loop's tuning.
    pub(crate) tuned: Stats,
    /// That / the hand-written loop, per round.
    pub(crate) tuned_vs_hand: Stats,
    pub(crate) raw_tuning: String,
    pub(crate) hand_tuning: String,
    pub(crate) peak_rss_mib: f64,
}

/// How the contenders are measured.
pub(crate) struct Plan {
    /// Messages per sweep run.
    pub(crate) sweep_n: usize,
    /// Seconds each measured run should last (its count is the swept rate
    /// times this, plus 10% untimed warm-up).
    pub(crate) secs: f64,
    pub(crate) rounds: usize,
    /// Messages for the per-event memory measurement.
    pub(crate) memory_n: usize,
    /// How to preload (the best raw publisher tuning).
    pub(crate) preload: PublishTuning,
}

struct RelativeUpdate {
    update: String,
}

impl Handler for RelativeUpdate {
    async fn handle(&self, conn: &mut PgConnection, _: &Event) -> Outcome {
        match sqlx::query(AssertSqlSafe(self.update.clone()))
            .bind(1i64)
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}

struct SetUpdate {
    update: String,
}

impl BatchHandler for SetUpdate {
    async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
        match sqlx::query(AssertSqlSafe(self.update.clone()))
            .bind(events.len() as i64)
            .execute(conn)
            .await
        {
            Ok(_) => BatchOutcome::All(Outcome::Ack),
            Err(e) => BatchOutcome::All(Outcome::retry(e)),
        }
    }
}

async fn consumer_schema(pool: &PgPool) -> Result<String> {
    let schema = format!("bench_cons_{}", suffix());
    outbox_consumer::migrate(pool, &schema).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".stock (sku text PRIMARY KEY, qty bigint NOT NULL); INSERT INTO \"{schema}\".stock VALUES ('A', 0);"
    )))
    .execute(pool)
    .await?;
    Ok(schema)
}

fn update_sql(schema: &str) -> String {
    format!("UPDATE \"{schema}\".stock SET qty = qty - $1 WHERE sku = 'A'")
}

async fn effects(pool: &PgPool, schema: &str) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT -qty FROM \"{schema}\".stock"
    )))
    .fetch_one(pool)
    .await?;
    Ok(n.max(0) as u64)
}

async fn inbox_rows(pool: &PgPool, schema: &str) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".inbox_processed"
    )))
    .fetch_one(pool)
    .await?;
    Ok(n as u64)
}

/// Where a run's progress is read: an in-memory count of acked messages,
/// or the committed effect (`stock`) of a database contender.
enum Progress {
    Acked(Arc<AtomicU64>),
    Committed(String),
}

impl Progress {
    async fn read(&self, pool: &PgPool) -> Result<u64> {
        match self {
            Progress::Acked(n) => Ok(n.load(AtomicOrdering::Relaxed)),
            Progress::Committed(schema) => effects(pool, schema).await,
        }
    }
}

/// One measured run of `who` over the `n` messages of `queue`: messages
/// per second between 10% and 100% of `n` done, polled every 10 ms; then
/// checks that every message left the queue and, for the database
/// contenders, that each has exactly one inbox row and one effect.
async fn run(pool: &PgPool, url: &str, queue: &str, n: usize, who: Contender) -> Result<f64> {
    let stop = CancellationToken::new();
    let large = large_inbox();
    let schema = match (who, &large) {
        (Contender::Raw(_), _) => None,
        (_, Some(large)) => {
            // Only this run's effects and records are counted.
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE \"{large}\".stock SET qty = 0"
            )))
            .execute(pool)
            .await?;
            Some(large.clone())
        }
        _ => Some(consumer_schema(pool).await?),
    };
    let records_before = match &large {
        Some(s) => inbox_rows(pool, s).await?,
        None => 0,
    };
    let acked = Arc::new(AtomicU64::new(0));
    let tasks: Vec<JoinHandle<Result<()>>> = match (who, &schema) {
        (Contender::Raw(t), _) => vec![tokio::spawn(raw_ack(
            url.to_owned(),
            queue.to_owned(),
            n as u64,
            t,
            acked.clone(),
        ))],
        (Contender::Hand(t), Some(s)) => {
            let mut v = Vec::new();
            for _ in 0..t.loops.max(1) {
                v.push(tokio::spawn(hand_written(
                    pool.clone(),
                    url.to_owned(),
                    queue.to_owned(),
                    s.clone(),
                    t,
                    stop.clone(),
                )));
            }
            v
        }
        (
            Contender::LibraryBatch | Contender::LibraryTuned(_) | Contender::LibraryPerEvent,
            Some(s),
        ) => {
            let batch = !matches!(who, Contender::LibraryPerEvent);
            let tuning = match who {
                Contender::LibraryTuned(t) => Some(t),
                _ => None,
            };
            let consumer = library(pool, url, queue, s, batch, tuning)?;
            let stop = stop.clone();
            vec![tokio::spawn(async move {
                consumer.run(stop).await.map_err(anyhow::Error::from)
            })]
        }
        _ => anyhow::bail!("no schema for a database contender"),
    };
    let progress = match &schema {
        None => Progress::Acked(acked),
        Some(s) => Progress::Committed(s.clone()),
    };
    let timed = time_progress(pool, &progress, (n / 10) as u64, n as u64, &tasks).await;
    stop.cancel();
    for t in tasks {
        t.await??;
    }
    let secs = timed?;
    if let Some(s) = &schema {
        let effects = effects(pool, s).await?;
        let inbox = inbox_rows(pool, s).await? - records_before;
        anyhow::ensure!(
            effects == n as u64 && inbox == n as u64,
            "{who:?}: {effects} effects and {inbox} inbox rows for {n} messages"
        );
        if large.is_none() {
            drop_schema(pool, s).await?;
        }
    }
    let conn = connect(url).await?;
    let ch = conn.create_channel().await?;
    let left = queue_depth(&ch, queue).await?;
    anyhow::ensure!(left == 0, "{who:?}: {left} messages left in {queue}");
    let _ = conn.close(200, "done".into()).await;
    Ok((n - n / 10) as f64 / secs)
}

async fn time_progress(
    pool: &PgPool,
    progress: &Progress,
    from: u64,
    to: u64,
    tasks: &[JoinHandle<Result<()>>],
) -> Result<f64> {
    let mut first = None;
    let mut last = (0, Instant::now());
    loop {
        // Read before the progress, so a contender that finished after its
        // last count is not taken for one that died.
        let finished = tasks.iter().all(|t| t.is_finished());
        let done = progress.read(pool).await?;
        let now = Instant::now();
        if done >= from && first.is_none() {
            first = Some(now);
        }
        if done >= to {
            return Ok(now.duration_since(first.unwrap_or(now)).as_secs_f64());
        }
        if done != last.0 {
            last = (done, now);
        }
        anyhow::ensure!(
            now.duration_since(last.1) < STALL,
            "stuck at {done} of {to}"
        );
        anyhow::ensure!(!finished, "the contender stopped at {done} of {to}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn library(
    pool: &PgPool,
    url: &str,
    queue: &str,
    schema: &str,
    batch: bool,
    tuning: Option<HandTuning>,
) -> Result<Consumer> {
    let mut cfg = ConsumerConfig::new(url, queue, "bench");
    cfg.schema = schema.to_string();
    cfg.declare_retry_queues = false;
    if let Some(t) = tuning {
        cfg.prefetch = t.prefetch;
        cfg.batch_size = t.batch;
        cfg.batch_max_wait = Duration::from_millis(t.linger_ms);
    }
    let update = update_sql(schema);
    Ok(if batch {
        Consumer::with_batch_handler(cfg, pool.clone(), SetUpdate { update })?
    } else {
        Consumer::new(cfg, pool.clone(), RelativeUpdate { update })?
    })
}

async fn raw_ack(
    url: String,
    queue: String,
    n: u64,
    t: RawTuning,
    acked: Arc<AtomicU64>,
) -> Result<()> {
    let conn = connect(&url).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(t.prefetch, BasicQosOptions::default()).await?;
    let mut c = ch
        .basic_consume(
            queue.as_str().into(),
            "raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    // Small runs ack more often, so the clock sees progress before the end.
    let every = (t.ack_every as u64).min((n / 20).max(1));
    let mut seen = 0u64;
    while seen < n {
        let d = tokio::time::timeout(STALL, c.next())
            .await
            .context("no delivery")?
            .context("queue ended")??;
        seen += 1;
        if seen.is_multiple_of(every) || seen == n {
            d.acker.ack(BasicAckOptions { multiple: true }).await?;
            acked.store(seen, AtomicOrdering::Relaxed);
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// What a careful engineer writes by hand (see [`HandTuning`]); keys are
/// sorted like the library's so concurrent loops cannot deadlock.
async fn hand_written(
    pool: PgPool,
    url: String,
    queue: String,
    schema: String,
    t: HandTuning,
    stop: CancellationToken,
) -> Result<()> {
    let conn = connect(&url).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(t.prefetch, BasicQosOptions::default()).await?;
    let mut c = ch
        .basic_consume(
            queue.as_str().into(),
            "hand".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let inbox = format!(
        "INSERT INTO \"{schema}\".inbox_processed (consumer, event_id, event_at) SELECT 'bench', k, \"{schema}\".inbox_event_time(k) FROM unnest($1::text[]) AS k ON CONFLICT (consumer, event_id, event_at) DO NOTHING RETURNING event_id"
    );
    let update = update_sql(&schema);
    let together = format!(
        "WITH fresh AS ({inbox}) UPDATE \"{schema}\".stock SET qty = qty - (SELECT count(*) FROM fresh) WHERE sku = 'A'"
    );
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => break,
            d = c.next() => d.context("queue ended")??,
        };
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + Duration::from_millis(t.linger_ms);
        while batch.len() < t.batch {
            match tokio::time::timeout_at(until, c.next()).await {
                Ok(Some(d)) => batch.push(d?),
                _ => break,
            }
        }
        let mut ids: Vec<String> = batch
            .iter()
            .map(|d| {
                d.properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            })
            .collect();
        ids.sort_unstable();
        if t.one_statement {
            sqlx::query(AssertSqlSafe(together.clone()))
                .bind(&ids)
                .execute(&pool)
                .await?;
        } else {
            let mut tx = pool.begin().await?;
            let fresh: Vec<String> = sqlx::query_scalar(AssertSqlSafe(inbox.clone()))
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(update.clone()))
                .bind(fresh.len() as i64)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
        if let Some(last) = batch.last() {
            last.acker.ack(BasicAckOptions { multiple: true }).await?;
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// A fresh durable queue holding `n` preloaded messages.
async fn loaded_queue(conn: &Connection, n: usize, preload: PublishTuning) -> Result<String> {
    let queue = format!("bench.cons.{}", suffix());
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        queue.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        queue_args(),
    )
    .await?;
    publish(conn, "", &queue, n, preload).await?;
    let _ = ch.close(200, "done".into()).await;
    Ok(queue)
}

async fn measured(
    pool: &PgPool,
    url: &str,
    n: usize,
    who: Contender,
    preload: PublishTuning,
) -> Result<f64> {
    attempt(&who.to_string(), || async move {
        let conn = connect(url).await?;
        let queue = loaded_queue(&conn, n, preload).await?;
        // Let the broker settle after the preload before the clock runs.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rate = run(pool, url, &queue, n, who).await;
        drop_queue(&conn, &queue).await?;
        let _ = conn.close(200, "done".into()).await;
        rate
    })
    .await
}

/// The fastest of `tunings` over `plan.sweep_n` messages each, and its
/// rate ([`sweep_best`]).
async fn best_of(
    pool: &PgPool,
    url: &str,
    plan: &Plan,
    tunings: &[Contender],
) -> Result<(Contender, f64)> {
    sweep_best("sweep", tunings, |who| {
        measured(pool, url, plan.sweep_n, who, plan.preload)
    })
    .await
}

/// Sweeps the baselines' tunings, then runs `rounds` rounds of the four
/// contenders in rotating order.
pub(crate) async fn measure(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    plan: &Plan,
) -> Result<ConsumerResults> {
    let raw: Vec<Contender> = RAW_SWEEP.into_iter().map(Contender::Raw).collect();
    let hand: Vec<Contender> = HAND_SWEEP.into_iter().map(Contender::Hand).collect();
    let best_raw = best_of(pool, url, plan, &raw).await?;
    let best_hand = best_of(pool, url, plan, &hand).await?;
    // Counts for runs of about `secs`: the library's rates are unknown
    // before the first round, so its counts follow the hand-written loop's
    // (per-event: a quarter of it). At most 500,000 a run: preloading
    // costs more broker time than consuming, and the raw ack-only consumer
    // would need most of a million for 10 s.
    let count = |rate: f64| ((rate * plan.secs * 1.1) as usize).clamp(1_000, 500_000);
    let order = [
        (best_raw.0, count(best_raw.1)),
        (best_hand.0, count(best_hand.1)),
        (Contender::LibraryBatch, count(best_hand.1)),
        (Contender::LibraryPerEvent, count(best_hand.1 / 4.0)),
        (
            Contender::LibraryTuned(match best_hand.0 {
                Contender::Hand(t) => t,
                _ => HAND_SWEEP[0],
            }),
            count(best_hand.1),
        ),
    ];
    let mut res = ConsumerResults {
        raw: Stats::default(),
        hand: Stats::default(),
        batch: Stats::default(),
        per_event: Stats::default(),
        batch_vs_raw: Stats::default(),
        batch_vs_hand: Stats::default(),
        tuned: Stats::default(),
        tuned_vs_hand: Stats::default(),
        raw_tuning: tuning_of(best_raw.0),
        hand_tuning: tuning_of(best_hand.0),
        peak_rss_mib: f64::NAN,
    };
    for round in 0..plan.rounds {
        let mut rates = [0.0; 5];
        for k in 0..order.len() {
            let i = (k + round) % order.len();
            let (who, n) = order[i];
            rates[i] = measured(pool, url, n, who, plan.preload).await?;
            eprintln!(
                "bench:   round {} {who} ({n}): {:.0}/s",
                round + 1,
                rates[i]
            );
        }
        res.raw.push(rates[0]);
        res.hand.push(rates[1]);
        res.batch.push(rates[2]);
        res.per_event.push(rates[3]);
        res.batch_vs_raw.push(rates[2] / rates[0]);
        res.batch_vs_hand.push(rates[2] / rates[1]);
        res.tuned.push(rates[4]);
        res.tuned_vs_hand.push(rates[4] / rates[1]);
    }
    res.peak_rss_mib = attempt("consumer memory", || async {
        let conn = connect(url).await?;
        let queue = loaded_queue(&conn, plan.memory_n, plan.preload).await?;
        let rss = child_rss(database_url, url, &queue, plan.memory_n);
        drop_queue(&conn, &queue).await?;
        let _ = conn.close(200, "done".into()).await;
        rss
    })
    .await?;
    Ok(res)
}

fn tuning_of(who: Contender) -> String {
    match who {
        Contender::Raw(t) => t.to_string(),
        Contender::Hand(t) => t.to_string(),
        other => other.to_string(),
    }
}

/// Runs the per-event consumer in a child process (this binary with
/// `--child-consumer`) and reads its peak RSS before it exits.
fn child_rss(database_url: &str, url: &str, queue: &str, n: usize) -> Result<f64> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child-consumer", queue, &n.to_string()])
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("child stdout")?).read_line(&mut line)?;
    anyhow::ensure!(line.trim() == "done", "child consumer failed: {line:?}");
    let rss = peak_rss_mib(child.id()).unwrap_or(f64::NAN);
    drop(child.stdin.take());
    child.wait()?;
    Ok(rss)
}

/// The child side of [`child_rss`]: consume `n` messages with the
/// per-event library consumer, say `done`, wait for stdin to close.
pub(crate) async fn child_consumer(pool: &PgPool, url: &str, queue: &str, n: usize) -> Result<()> {
    run(pool, url, queue, n, Contender::LibraryPerEvent).await?;
    println!("done");
    std::io::stdout().flush()?;
    let mut sink = String::new();
    let _ = std::io::stdin().read_line(&mut sink);
    Ok(())
}

/// The library consumer's effects per second on the queues the harness
/// declares now (quorum, in the quorum section): `rounds` runs of the
/// batch handler and of the per-event handler, alternating.
pub(crate) async fn library_rates(
    pool: &PgPool,
    url: &str,
    n: usize,
    rounds: usize,
    preload: PublishTuning,
) -> Result<(Stats, Stats)> {
    let (mut batch, mut per_event) = (Stats::default(), Stats::default());
    for round in 0..rounds {
        for k in 0..2 {
            if (k + round) % 2 == 0 {
                let rate = measured(pool, url, n, Contender::LibraryBatch, preload).await?;
                eprintln!(
                    "bench:   round {} batch handler ({n}): {rate:.0}/s",
                    round + 1
                );
                batch.push(rate);
            } else {
                let m = (n / 4).max(1_000);
                let rate = measured(pool, url, m, Contender::LibraryPerEvent, preload).await?;
                eprintln!(
                    "bench:   round {} per-event handler ({m}): {rate:.0}/s",
                    round + 1
                );
                per_event.push(rate);
            }
        }
    }
    Ok((batch, per_event))
}

/// The schema whose inbox the library's runs use instead of a fresh one
/// (the large-inbox rounds: the seeded schema or its empty twin), or
/// `None`.
static LARGE_INBOX: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn large_inbox() -> Option<String> {
    LARGE_INBOX.lock().map(|s| s.clone()).unwrap_or(None)
}

fn use_large_inbox(schema: Option<String>) {
    if let Ok(mut s) = LARGE_INBOX.lock() {
        *s = schema;
    }
}

/// A consumer schema whose inbox holds `per_day` records of today (keys
/// dated from midnight to now, as `Outbox::enqueue` writes them) and
/// `per_day` of a day ten days ago, for the consumer name the library
/// runs use. Returns the schema and the old day's partition.
async fn seeded_inbox(pool: &PgPool, per_day: u64) -> Result<(String, String)> {
    let schema = consumer_schema(pool).await?;
    let s = format!("\"{schema}\"");
    let old = (chrono::Utc::now() - chrono::Duration::days(10)).date_naive();
    let part = format!("inbox_p{}", old.format("%Y%m%d"));
    let from = old.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc();
    let seed = |start: String, span_ms: String| {
        format!(
            "INSERT INTO {s}.inbox_processed (consumer, event_id, event_at)
             SELECT 'bench', k, {s}.inbox_event_time(k) FROM (
                 SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7000-8000-' || lpad(to_hex(i), 12, '0') AS k
                 FROM (SELECT i, lpad(to_hex(({start}) + i * ({span_ms}) / {per_day}), 12, '0') AS h
                       FROM generate_series(1, {per_day}) i) t) keys"
        )
    };
    let ms = |t: &str| format!("(extract(epoch FROM {t}) * 1000)::bigint");
    for sql in [
        format!(
            "CREATE TABLE {s}.{part} PARTITION OF {s}.inbox_processed FOR VALUES FROM ('{}') TO ('{}')",
            from.to_rfc3339(),
            (from + chrono::Duration::days(1)).to_rfc3339()
        ),
        seed(
            format!("{}::bigint", from.timestamp_millis()),
            "86399000::bigint".to_owned(),
        ),
        seed(
            ms("date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"),
            format!(
                "({} - {})",
                ms("now()"),
                ms("date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'")
            ),
        ),
    ] {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
    }
    settled(pool, &schema).await?;
    Ok((schema, part))
}

/// A consumer schema with an empty inbox, prepared as [`seeded_inbox`]'s.
async fn twin_schema(pool: &PgPool) -> Result<String> {
    let twin = consumer_schema(pool).await?;
    if let Err(e) = settled(pool, &twin).await {
        drop_schema(pool, &twin).await?;
        return Err(e);
    }
    Ok(twin)
}

/// `schema`'s tables vacuumed and analysed, and every page written out now,
/// not during the measured runs (their commits would wait on the disk
/// behind them).
async fn settled(pool: &PgPool, schema: &str) -> Result<()> {
    let s = format!("\"{schema}\"");
    for sql in [
        format!("VACUUM ANALYZE {s}.inbox_processed, {s}.stock"),
        "CHECKPOINT".to_owned(),
    ] {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
    }
    Ok(())
}

/// What the large-inbox rounds measured.
pub(crate) struct LargeInbox {
    pub(crate) empty: Stats,
    pub(crate) large: Stats,
    /// Records in the inbox during the large rounds.
    pub(crate) records: u64,
    /// Seconds retention took to remove the old day.
    pub(crate) retention_s: f64,
    /// The largest DELETE retention ran, in rows.
    pub(crate) retention_rows_deleted: u64,
}

/// The library's batch handler over `n` messages, `rounds` times with an
/// empty inbox and with a seeded one (`per_day` records of today and of a
/// day ten days ago), alternating; then retention removes the old day.
pub(crate) async fn large_inbox_rates(
    pool: &PgPool,
    url: &str,
    n: usize,
    rounds: usize,
    per_day: u64,
    preload: PublishTuning,
) -> Result<LargeInbox> {
    eprintln!("bench: seeding an inbox with {} records", 2 * per_day);
    let seeding = Instant::now();
    let (schema, part) = seeded_inbox(pool, per_day).await?;
    eprintln!(
        "bench:   seeded in {:.0} s",
        seeding.elapsed().as_secs_f64()
    );
    let records = inbox_rows(pool, &schema).await?;
    // The empty inbox's runs get a schema prepared the same way and reused
    // the same way: analysed and checkpointed, its effects and records
    // growing by `n` a run as the seeded one's do. (A fresh schema per
    // run, without statistics and under autovacuum's first passes, once
    // made the empty runs half as fast as the large ones: 1.72.)
    let twin = match twin_schema(pool).await {
        Ok(twin) => twin,
        Err(e) => {
            drop_schema(pool, &schema).await?;
            return Err(e);
        }
    };
    let (mut empty, mut large) = (Stats::default(), Stats::default());
    let measuring = async {
        for round in 0..rounds {
            for k in 0..2 {
                let with_large = (k + round) % 2 == 1;
                use_large_inbox(Some(if with_large { &schema } else { &twin }.clone()));
                let rate = measured(pool, url, n, Contender::LibraryBatch, preload).await;
                use_large_inbox(None);
                let rate = rate?;
                let what = if with_large { "large" } else { "empty" };
                eprintln!(
                    "bench:   round {} {what} inbox ({n}): {rate:.0}/s",
                    round + 1
                );
                if with_large {
                    large.push(rate)
                } else {
                    empty.push(rate)
                }
            }
        }
        anyhow::Ok(())
    };
    let measured_rounds = measuring.await;
    let retention = async {
        let started = Instant::now();
        let report = outbox_consumer::inbox_retention(
            pool,
            &schema,
            None,
            outbox_consumer::DEFAULT_RETENTION,
        )
        .await?;
        let secs = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            report.days_dropped == vec![part.clone()],
            "retention dropped {:?}, not {part}",
            report.days_dropped
        );
        anyhow::Ok((secs, report.rows_deleted))
    }
    .await;
    drop_schema(pool, &schema).await?;
    drop_schema(pool, &twin).await?;
    measured_rounds?;
    let (retention_s, retention_rows_deleted) = retention?;
    Ok(LargeInbox {
        empty,
        large,
        records,
        retention_s,
        retention_rows_deleted,
    })
}
