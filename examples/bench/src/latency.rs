//! Latency without coordinated omission: events are committed open-loop
//! against a schedule (one task per event, so a slow commit never delays
//! the next send), the relay runs in its own process, and the effect is
//! stamped only once the consumer's transaction has committed (its
//! handler sends a `NOTIFY`, which PostgreSQL delivers after COMMIT).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use outbox::{NewEvent, Outbox, OutboxConfig};
use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::minimal::LoopTuning;
use crate::minimal_wal::ReaderTuning;
use crate::relay::{spawn_relay, stop_child};
use crate::stages::{self, Batch, Clock, Seen, StageLog};

/// What moves the events from the outbox to the broker in a latency run.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Relayer {
    /// The relay binary in its own process (with its defaults).
    Binary,
    /// The table's hand-written loop ([`crate::minimal::follow`]), with
    /// its burden if any (`--latency-hand-written-burden`).
    Minimal(LoopTuning, Option<u64>),
    /// The same loop ([`TABLE_LOOPS`]) in a process of its own: this
    /// binary again, with `--child-relayer` (`--latency-hand-written-apart`).
    MinimalApart(Option<u64>),
    /// The log's hand-written reader ([`crate::minimal_wal::follow`]).
    MinimalWal(ReaderTuning),
    /// The relay's code (table capture, default settings, the binary's
    /// pool settings) on a runtime of its own in this process
    /// (`--latency-relay-in-process`).
    InProcess,
}

/// A running [`Relayer`].
enum Running {
    /// With the file its stage trace goes to (`--latency-stages`).
    Binary(std::process::Child, Option<std::path::PathBuf>),
    /// A hand-written path on its own runtime, told to stop by its token,
    /// with the log its batches' stages go to (the table's loop only).
    HandWritten(
        CancellationToken,
        std::thread::JoinHandle<Result<()>>,
        Option<StageLog>,
    ),
}

impl Running {
    fn start(
        relayer: Relayer,
        database_url: &str,
        url: &str,
        schema: &str,
        exchange: &str,
        total: usize,
        stages: bool,
    ) -> Result<Self> {
        let owned = |s: &str| s.to_owned();
        let stop = CancellationToken::new();
        let log: Option<StageLog> = stages.then(StageLog::default);
        let handle = match relayer {
            Relayer::Binary => {
                let trace = stages
                    .then(|| std::env::temp_dir().join(format!("bench-stages-{}.log", suffix())));
                let child = spawn_relay(database_url, url, schema, exchange, trace.as_deref())?;
                return Ok(Running::Binary(child, trace));
            }
            Relayer::MinimalApart(burden) => {
                let trace = stages
                    .then(|| std::env::temp_dir().join(format!("bench-stages-{}.log", suffix())));
                let child = spawn_hand_written(
                    database_url,
                    url,
                    schema,
                    exchange,
                    burden,
                    trace.as_deref(),
                )?;
                return Ok(Running::Binary(child, trace));
            }
            Relayer::Minimal(tuning, burden) => crate::minimal::follow(
                owned(database_url),
                owned(url),
                owned(schema),
                owned(exchange),
                tuning,
                burden,
                log.clone(),
                stop.clone(),
            ),
            Relayer::InProcess => {
                stages::trace_in_process_to(log.clone());
                in_process(
                    owned(database_url),
                    owned(url),
                    owned(schema),
                    owned(exchange),
                    stop.clone(),
                )
            }
            Relayer::MinimalWal(tuning) => crate::minimal_wal::follow(
                owned(database_url),
                owned(url),
                owned(schema),
                owned(exchange),
                total,
                tuning,
                stop.clone(),
            ),
        };
        Ok(Running::HandWritten(stop, handle, log))
    }

    /// CPU seconds so far: this relayer's (the relay process, or the
    /// threads of the hand-written path's runtime with its broker
    /// connection's IO thread; for the relay's code in this process, its
    /// runtime's threads without its IO thread), PostgreSQL's and the
    /// broker's (all of their processes).
    fn cpu(&self) -> Cpu {
        let relayer = match self {
            Running::Binary(child, _) => cpu_seconds(None, Some(child.id())),
            Running::HandWritten(..) => thread_cpu_seconds(CONTENDER_THREAD),
        };
        Cpu {
            relayer,
            database: cpu_seconds(Some("postgres"), None),
            broker: cpu_seconds(Some("beam.smp"), None),
        }
    }

    /// Stops it (the run has seen every event on the queue, or failed);
    /// returns its batches' stages if they were recorded.
    async fn stop(self) -> Result<Option<Vec<Batch>>> {
        match self {
            Running::Binary(mut child, trace) => {
                let stopped = stop_child(&mut child);
                let Some(path) = trace else {
                    return stopped.map(|()| None);
                };
                let log = std::fs::read_to_string(&path);
                let _ = std::fs::remove_file(&path);
                let log = log?;
                // Its log went to the file: what else it said (warnings,
                // the error it failed with) is shown here.
                for line in log
                    .lines()
                    .filter(|l| !l.contains(r#""outbox_relay::stages""#))
                {
                    eprintln!("bench:   relayer: {line}");
                }
                stopped?;
                stages::parse_relay_trace(&log).map(Some)
            }
            Running::HandWritten(stop, handle, log) => {
                stop.cancel();
                let joined = join(handle).await;
                stages::trace_in_process_to(None);
                joined?;
                Ok(log.map(|log| std::mem::take(&mut *lock(&log))))
            }
        }
    }
}

/// The table's hand-written path in the latency sections: two loops (the
/// relay's two workers on two cores), each with the relay's default batch.
pub(crate) const TABLE_LOOPS: LoopTuning = LoopTuning {
    loops: 2,
    batch: 500,
};

/// This binary again, running the table's hand-written path on `schema`
/// into `exchange` until SIGTERM ([`child_relayer`]); with `stage_trace`,
/// its batches' stages go to that file. The URLs go by environment, not on
/// the command line, where `ps` would show a password.
fn spawn_hand_written(
    database_url: &str,
    url: &str,
    schema: &str,
    exchange: &str,
    burden: Option<u64>,
    stage_trace: Option<&std::path::Path>,
) -> Result<std::process::Child> {
    let mut child = std::process::Command::new(std::env::current_exe()?);
    child
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", url)
        .arg("--child-relayer")
        .arg(schema)
        .arg(exchange)
        .stdout(std::process::Stdio::null());
    if let Some(us) = burden {
        child
            .arg("--latency-hand-written-burden")
            .arg(us.to_string());
    }
    if let Some(path) = stage_trace {
        child
            .arg("--latency-stages")
            .stderr(std::fs::File::create(path)?);
    }
    child
        .spawn()
        .context("starting the hand-written path's process")
}

/// The child side of [`spawn_hand_written`]: the table's hand-written path
/// until SIGTERM; then, with `stages`, its batches on stderr as JSON lines
/// in the relay's trace format (so one reader reads both).
pub(crate) async fn child_relayer(
    database_url: String,
    url: String,
    schema: String,
    exchange: String,
    burden: Option<u64>,
    stages: bool,
) -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let stop = CancellationToken::new();
    let log = stages.then(StageLog::default);
    let handle = crate::minimal::follow(
        database_url,
        url,
        schema,
        exchange,
        TABLE_LOOPS,
        burden,
        log.clone(),
        stop.clone(),
    );
    tokio::select! {
        _ = term.recv() => {}
        // It failed: say why at once.
        _ = wait_until_finished(&handle) => {}
    }
    stop.cancel();
    join(handle).await?;
    for b in log
        .map(|log| std::mem::take(&mut *lock(&log)))
        .unwrap_or_default()
    {
        eprintln!("{}", stages::trace_line(&b));
    }
    Ok(())
}

/// The relay's code with its defaults on a runtime of its own (two
/// workers, as the binary's on two cores), on a pool set up as the
/// binary's (`workers + 3` connections, a 10 s acquire timeout, no ping at
/// each acquire; the binary also pings one idle for 2 s), until `stop`.
fn in_process(
    database_url: String,
    url: String,
    schema: String,
    exchange: String,
    stop: CancellationToken,
) -> std::thread::JoinHandle<Result<()>> {
    on_own_runtime(async move {
        let pool = PgPoolOptions::new()
            .max_connections(5)
            .acquire_timeout(Duration::from_secs(10))
            .test_before_acquire(false)
            .connect(&database_url)
            .await?;
        let config = crate::relay::relay_config(&url, &schema, &exchange);
        let relay = outbox_relay::Relay::new(pool, config).await?;
        relay.run(stop).await?;
        Ok(())
    })
}

/// CPU seconds of one run's parts ([`Running::cpu`]).
#[derive(Debug, Clone, Copy)]
struct Cpu {
    relayer: f64,
    database: f64,
    broker: f64,
}

impl Cpu {
    /// Milliseconds per event since `start`, named for the report.
    fn per_event(self, start: Cpu, events: usize) -> [(&'static str, f64); 3] {
        let ms = |now: f64, then: f64| (now - then) * 1e3 / events as f64;
        [
            (
                "latency_cpu_relayer_ms_per_event",
                ms(self.relayer, start.relayer),
            ),
            (
                "latency_cpu_database_ms_per_event",
                ms(self.database, start.database),
            ),
            (
                "latency_cpu_broker_ms_per_event",
                ms(self.broker, start.broker),
            ),
        ]
    }
}

type Stamps = Arc<Mutex<HashMap<String, Instant>>>;

/// Writes the effect row and, in the same transaction, a notification
/// carrying the event id: the listener sees it only after COMMIT.
struct NotifyEffect {
    insert: String,
    channel: String,
}

impl Handler for NotifyEffect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        match sqlx::query(AssertSqlSafe(self.insert.clone()))
            .bind(event.id())
            .bind(&self.channel)
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}

/// One event's clock readings.
struct Sent {
    id: String,
    scheduled: Instant,
    committed: Instant,
}

/// What one run measured (milliseconds).
pub(crate) struct LatencyRun {
    pub(crate) offered_per_s: f64,
    pub(crate) achieved_per_s: f64,
    /// (name, samples) for publish/effect latency from schedule/commit.
    pub(crate) samples: Vec<(&'static str, Vec<f64>)>,
    /// CPU milliseconds per event of the relayer, PostgreSQL and the
    /// broker, from the first event offered to the last one applied
    /// (PostgreSQL's and the broker's include the producers' and the
    /// consumer's work, the same for every relayer).
    pub(crate) cpu_ms_per_event: [(&'static str, f64); 3],
    /// Where the counted events' latency went ([`stages::breakdown`]),
    /// when the relayer's stages were recorded (`--latency-stages`; the
    /// table's relayers only).
    pub(crate) stages: Vec<(&'static str, f64)>,
}

/// Offers `rate` events/s for `warm + secs` seconds with the default
/// wake-up, moved to the broker by `relayer`; the first `warm` seconds
/// are not counted. With `stages`, the relayer's batches are recorded and
/// lined up with the events.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn latency(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    relayer: Relayer,
    rate: f64,
    warm: f64,
    secs: f64,
    stages: bool,
) -> Result<LatencyRun> {
    let schema = fresh_schema(pool, "lat").await?;
    let consumer_schema = format!("{schema}_c");
    let name = format!("bench.lat.{}", suffix());
    let effect_queue = format!("{name}.effects");
    let conn = match connect(url).await {
        Ok(conn) => conn,
        Err(e) => {
            let _ = drop_schema(pool, &schema).await;
            return Err(e);
        }
    };
    let outcome: Result<LatencyRun> = async {
        outbox_consumer::migrate(pool, &consumer_schema).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE \"{consumer_schema}\".effects (event_id text PRIMARY KEY)"
        )))
        .execute(pool)
        .await?;
        topology(&conn, &name).await?;
        bind_queue(&conn, &name, &effect_queue).await?;
        let published: Stamps = Arc::default();
        let effects: Stamps = Arc::default();

        // Publish: a plain consumer notes each arrival.
        let ch = conn.create_channel().await?;
        let mut raw = ch
            .basic_consume(
                name.as_str().into(),
                "bench".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let raw_task = tokio::spawn({
            let published = published.clone();
            async move {
                while let Some(Ok(d)) = raw.next().await {
                    let now = Instant::now();
                    if let Some(id) = d.properties.message_id() {
                        lock(&published).insert(id.to_string(), now);
                    }
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                }
            }
        });
        // Effect: the notification that follows the consumer's COMMIT.
        let channel = format!("bench_effect_{}", suffix());
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(&channel).await?;
        let listen_task = tokio::spawn({
            let effects = effects.clone();
            async move {
                while let Ok(n) = listener.recv().await {
                    let now = Instant::now();
                    lock(&effects).insert(n.payload().to_owned(), now);
                }
            }
        });
        let stop = CancellationToken::new();
        let mut cfg = ConsumerConfig::new(url, &effect_queue, "bench");
        cfg.schema = consumer_schema.to_string();
        cfg.declare_retry_queues = false;
        let handler = NotifyEffect {
            insert: format!(
                "INSERT INTO \"{consumer_schema}\".effects (event_id) SELECT $1::text FROM pg_notify($2, $1)"
            ),
            channel,
        };
        let consumer = Consumer::new(cfg, pool.clone(), handler)?;
        let consumer_task = tokio::spawn({
            let stop = stop.clone();
            async move { consumer.run(stop).await }
        });
        // The consumer's connection is open before the relayer starts, so the
        // one a hand-written relayer opens is told apart (its CPU is counted).
        let total = ((warm + secs) * rate) as usize;
        let started = match consumed(&ch, &effect_queue).await {
            Ok(()) => Running::start(relayer, database_url, url, &schema, &name, total, stages),
            Err(e) => Err(e),
        };
        let relay = match started {
            Ok(relay) => relay,
            Err(e) => {
                stop.cancel();
                raw_task.abort();
                listen_task.abort();
                let _ = tokio::time::timeout(Duration::from_secs(30), consumer_task).await;
                return Err(e);
            }
        };
        // Every wait bounded: a run that hangs (seen once, in the hand-written
        // path's run, for 600 s) fails, and `attempt` runs it again.
        let offered = offer(
            pool, &schema, rate, warm, secs, &published, &effects, &relay,
        );
        let result = tokio::time::timeout(Duration::from_secs_f64(warm + secs + 90.0), offered)
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the run did not end within its time")));
        stop.cancel();
        // The recorders first: a stop that fails below must not keep the
        // listener's connection of the bench's pool.
        raw_task.abort();
        listen_task.abort();
        let stopping = Duration::from_secs(30);
        let batches = tokio::time::timeout(stopping, relay.stop())
            .await
            .context("the relayer did not stop within 30 s")??;
        tokio::time::timeout(stopping, consumer_task)
            .await
            .context("the consumer did not stop within 30 s")???;
        let (mut run, total, seen) = result?;
        if let Some(batches) = batches {
            // The log's relayers move events without the table's batches (the
            // relay's table workers only find nothing).
            let moved = batches.iter().any(|b| !b.ids.is_empty());
            anyhow::ensure!(
                moved || capture() == outbox::Capture::Wal,
                "--latency-stages: the relayer recorded no batch that moved an event"
            );
            if moved {
                run.stages = stages::breakdown(&seen, &batches);
            }
        }
        let effect_rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{consumer_schema}\".effects"
        )))
        .fetch_one(pool)
        .await?;
        anyhow::ensure!(
            effect_rows == total as i64,
            "{effect_rows} effects for {total} events"
        );
        Ok(run)
    }
    .await;
    // Whatever the outcome (a failed run is retried by `attempt`), its
    // queues, exchange and schemas do not outlive it.
    let cleaned = [
        drop_queue(&conn, &name).await,
        drop_queue(&conn, &effect_queue).await,
        drop_schema(pool, &schema).await,
        drop_schema(pool, &consumer_schema).await,
    ];
    let _ = conn.close(200, "done".into()).await;
    let run = outcome?;
    cleaned.into_iter().collect::<Result<()>>()?;
    Ok(run)
}

/// The producer side of [`latency`]: sends, waits for every arrival,
/// computes the figures (with the CPU `relay` and the services used
/// meanwhile); also returns how many events were sent and when each
/// counted one was committed and arrived.
#[allow(clippy::too_many_arguments)]
async fn offer(
    pool: &PgPool,
    schema: &str,
    rate: f64,
    warm: f64,
    secs: f64,
    published: &Stamps,
    effects: &Stamps,
    relay: &Running,
) -> Result<(LatencyRun, usize, Vec<Seen>)> {
    // Its own pool, large enough that an open-loop burst waits on the
    // database rather than on the pool.
    let producer_pool = PgPoolOptions::new()
        .max_connections(32)
        .min_connections(8)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let ob = Outbox::new(&producer_pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.capture = capture();
        c
    })
    .await?;
    // The relay process connects and starts listening meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let total = ((warm + secs) * rate) as usize;
    let skip = (warm * rate) as usize;
    let body = payload();
    let cpu = relay.cpu();
    let t0 = Instant::now() + Duration::from_millis(10);
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let scheduled = t0 + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(scheduled.into()).await;
        let (pool, ob) = (producer_pool.clone(), ob.clone());
        let event = NewEvent::new("order", i.to_string(), "OrderPlaced", &body)?;
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await?;
            let id = ob.enqueue(&mut *tx, event).await?;
            ob.commit(tx).await?;
            Ok::<_, anyhow::Error>(Sent {
                id: id.to_string(),
                scheduled,
                committed: Instant::now(),
            })
        }));
    }
    let mut sent = Vec::with_capacity(total);
    for t in tasks {
        sent.push(t.await??);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while (lock(published).len() < total || lock(effects).len() < total)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cpu_ms_per_event = relay.cpu().per_event(cpu, total);
    let (published, effects) = (lock(published).clone(), lock(effects).clone());
    anyhow::ensure!(
        published.len() >= total && effects.len() >= total,
        "only {}/{} of {total} events published/applied",
        published.len(),
        effects.len()
    );
    let counted = &sent[skip..];
    let first = counted.first().context("no events counted")?.scheduled;
    let last = counted
        .iter()
        .map(|s| s.committed)
        .max()
        .context("no events counted")?;
    let achieved = counted.len() as f64 / last.duration_since(first).as_secs_f64();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let clock = Clock::now();
    let mut seen = Vec::with_capacity(counted.len());
    let mut samples: Vec<(&'static str, Vec<f64>)> = vec![
        ("publish_latency", vec![]),
        ("publish_latency_sched", vec![]),
        ("effect_latency", vec![]),
        ("effect_latency_sched", vec![]),
    ];
    for s in counted {
        let p = published.get(&s.id).context("event not published")?;
        let e = effects.get(&s.id).context("event not applied")?;
        seen.push(Seen {
            id: s.id.clone(),
            committed_us: clock.unix_us(s.committed),
            arrived_us: clock.unix_us(*p),
        });
        samples[0]
            .1
            .push(ms(p.saturating_duration_since(s.committed)));
        samples[1]
            .1
            .push(ms(p.saturating_duration_since(s.scheduled)));
        samples[2]
            .1
            .push(ms(e.saturating_duration_since(s.committed)));
        samples[3]
            .1
            .push(ms(e.saturating_duration_since(s.scheduled)));
    }
    producer_pool.close().await;
    Ok((
        LatencyRun {
            offered_per_s: rate,
            achieved_per_s: achieved,
            samples,
            cpu_ms_per_event,
            stages: Vec::new(),
        },
        total,
        seen,
    ))
}

/// p50, p95, p99 and max of `samples`, named `<prefix>_p50_ms` and so on.
pub(crate) fn percentiles(prefix: &str, samples: &[f64]) -> Vec<(String, f64)> {
    let mut l = samples.to_vec();
    l.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    vec![
        (format!("{prefix}_p50_ms"), pct(0.50)),
        (format!("{prefix}_p95_ms"), pct(0.95)),
        (format!("{prefix}_p99_ms"), pct(0.99)),
        (
            format!("{prefix}_max_ms"),
            l.last().copied().unwrap_or(f64::NAN),
        ),
    ]
}
