//! Shared set-up: fresh schemas, queues and payloads per measurement.

use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::Result;
use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind, PublisherConfirm,
};
use outbox::{NewEvent, OrderedAggregates, Outbox, OutboxConfig, Wakeup};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};

/// Payload size of every benchmark event, in bytes of JSON.
pub(crate) const PAYLOAD_BYTES: usize = 500;

/// The guard of `m`, also after a thread panicked holding it (the bench's
/// logs and stamps stay readable).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

pub(crate) fn payload() -> Value {
    json!({ "pad": "x".repeat(PAYLOAD_BYTES - 10) })
}

/// A connection to `url`, or to the first that answers of several
/// comma-separated URLs (a cluster), each try bounded: an unbounded
/// connect once held a quorum run for good (no socket open, every thread
/// parked), where [`attempt`] can retry a failed one.
pub(crate) async fn connect(url: &str) -> Result<Connection> {
    const TIMEOUT: Duration = Duration::from_secs(10);
    let mut last = None;
    for u in outbox::urls::split_urls(url) {
        match tokio::time::timeout(
            TIMEOUT,
            Connection::connect(u, ConnectionProperties::default()),
        )
        .await
        {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => last = Some(anyhow::Error::from(e)),
            Err(_) => last = Some(anyhow::anyhow!("no AMQP connection within {TIMEOUT:?}")),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no AMQP URL")))
}

/// Whether the queues the harness declares are quorum queues (the quorum
/// section sets it for its duration; sections run one after another).
static QUORUM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Declares quorum queues from now on (`true`) or classic ones.
pub(crate) fn use_quorum_queues(on: bool) {
    QUORUM.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether producers write to the write-ahead log and relays read the
/// schema's slot (the `wal` section sets it for its duration).
static WAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The database URL in-process relays read the slot over (`--capture wal`).
pub(crate) static DATABASE_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Writes events to the write-ahead log from now on (`true`), or to the
/// outbox table.
pub(crate) fn use_wal_capture(on: bool) {
    WAL.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// How producers write now.
pub(crate) fn capture() -> outbox::Capture {
    if WAL.load(std::sync::atomic::Ordering::Relaxed) {
        outbox::Capture::Wal
    } else {
        outbox::Capture::Table
    }
}

/// The arguments of a queue the harness declares.
pub(crate) fn queue_args() -> FieldTable {
    let mut args = FieldTable::default();
    if QUORUM.load(std::sync::atomic::Ordering::Relaxed) {
        args.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
    }
    args
}

/// A durable topic exchange `name` and durable queue `name` bound with `#`.
pub(crate) async fn topology(conn: &Connection, name: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await?;
    bind_queue(conn, name, name).await
}

/// A durable queue `queue` bound to `exchange` with `#`.
pub(crate) async fn bind_queue(conn: &Connection, exchange: &str, queue: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), q, queue_args()).await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

pub(crate) async fn drop_queue(conn: &Connection, name: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    ch.queue_delete(name.into(), QueueDeleteOptions::default())
        .await?;
    let _ = ch.exchange_delete(name.into(), Default::default()).await;
    Ok(())
}

/// A migrated schema; with WAL capture on, with its slot and publication
/// (`outbox-relay migrate --capture wal`).
pub(crate) async fn fresh_schema(pool: &PgPool, prefix: &str) -> Result<String> {
    let schema = format!("bench_{prefix}_{}", suffix());
    outbox::migrate(pool, &schema).await?;
    if capture() == outbox::Capture::Wal {
        let ident = outbox::Ident::new("schema", &schema)?;
        outbox_relay::create_wal_slot(pool, &ident, None).await?;
    }
    Ok(schema)
}

/// Drops the schema, and its slot and publication if it has them.
pub(crate) async fn drop_schema(pool: &PgPool, schema: &str) -> Result<()> {
    if let Ok(ident) = outbox::Ident::new("schema", schema) {
        // A stopped relay's replication session may outlive it briefly.
        let until = Instant::now() + Duration::from_secs(10);
        while let Err(e) = outbox_relay::drop_wal_slot(pool, &ident).await {
            anyhow::ensure!(Instant::now() < until, "dropping the slot of {schema}: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Fills the outbox of `schema` with `n` events over `aggregates`
/// aggregates (round robin), 1,000 per statement; `ordering` says which are
/// ordered.
pub(crate) async fn fill_outbox(
    pool: &PgPool,
    schema: &str,
    n: usize,
    ordering: OrderedAggregates,
    aggregates: usize,
) -> Result<()> {
    if ordering == OrderedAggregates::All {
        outbox::set_ordered(pool, schema, outbox::ALL_TYPES, true).await?;
    }
    let ob = Outbox::new(pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.wakeup = Wakeup::PollOnly;
        c.ordering = ordering;
        c.capture = capture();
        c
    })
    .await?;
    let body = payload();
    for start in (0..n).step_by(1000) {
        let events = (start..(start + 1000).min(n))
            .map(|i| {
                NewEvent::new(
                    "order",
                    format!("o-{}", i % aggregates.max(1)),
                    "OrderPlaced",
                    &body,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut tx = pool.begin().await?;
        ob.enqueue_many(&mut *tx, events).await?;
        tx.commit().await?;
    }
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE \"{schema}\".outbox")))
        .execute(pool)
        .await?;
    Ok(())
}

/// Rows left in the outbox of `schema`: a full count, so only for checks
/// once a measurement is over, never to follow progress.
pub(crate) async fn outbox_len(pool: &PgPool, schema: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".outbox"
    )))
    .fetch_one(pool)
    .await?)
}

/// Waits (polling every 50 ms, bounded by `limit`) until the outbox of
/// `schema` is empty (WAL capture: and the slot has passed the log's end
/// as it is now): the check after a drain, not its clock.
pub(crate) async fn wait_outbox_empty(pool: &PgPool, schema: &str, limit: Duration) -> Result<()> {
    let until = Instant::now() + limit;
    if capture() == outbox::Capture::Wal {
        let slot = format!("outbox_{schema}");
        let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(pool)
            .await?;
        loop {
            let past: Option<bool> = sqlx::query_scalar(
                "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .bind(&target)
            .fetch_optional(pool)
            .await?;
            if past == Some(true) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < until,
                "slot {slot} not past {target} after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    loop {
        let left = outbox_len(pool, schema).await?;
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "{left} events still in the outbox after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Messages ready in `queue`, from a passive declare: the broker answers
/// from its own counter, so following a drain this way costs the database
/// nothing (the old harness ran `count(*)` over the backlog every 5 ms).
pub(crate) async fn queue_depth(ch: &Channel, queue: &str) -> Result<u64> {
    Ok(u64::from(passive_declare(ch, queue).await?.message_count()))
}

/// `queue` as the broker counts it now (it must exist).
async fn passive_declare(ch: &Channel, queue: &str) -> Result<lapin::Queue> {
    let options = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    Ok(ch
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?)
}

/// Waits (10 s at most) until `queue` has a consumer.
pub(crate) async fn consumed(ch: &Channel, queue: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while passive_declare(ch, queue).await?.consumer_count() == 0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "no consumer on {queue} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// When `queue` held `from` and then `to` messages, polled every 20 ms;
/// gives up when nothing arrives for `stall`.
pub(crate) async fn time_queue_fill(
    ch: &Channel,
    queue: &str,
    from: u64,
    to: u64,
    stall: Duration,
) -> Result<(Instant, Instant)> {
    let mut first = None;
    let mut last_seen = (0, Instant::now());
    loop {
        let depth = queue_depth(ch, queue).await?;
        let now = Instant::now();
        if depth >= from && first.is_none() {
            first = Some(now);
        }
        if depth >= to {
            return Ok((first.unwrap_or(now), now));
        }
        if depth != last_seen.0 {
            last_seen = (depth, now);
        }
        anyhow::ensure!(
            now.duration_since(last_seen.1) < stall,
            "{queue} stuck at {depth} of {to} messages"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Hands every publish's frames to lapin's IO loop before awaiting any
/// of their writes, in the order given; returns their confirms.
/// `basic_publish` resolves only once the IO loop has written the frames,
/// so awaiting each in turn costs a hand-off between the two tasks per
/// message (the relay queues a batch the same way): every hand-written
/// ceiling publishes through this. (A `Vec`, not an iterator: a closure
/// held across the awaits would make the caller's future not `Send`.)
pub(crate) async fn queue_all<F, E>(publishes: Vec<F>) -> Result<Vec<PublisherConfirm>>
where
    F: Future<Output = std::result::Result<PublisherConfirm, E>>,
    E: Into<anyhow::Error>,
{
    let mut writing = Vec::new();
    for p in publishes {
        let mut p = Box::pin(p);
        // The first poll takes the delivery tag and queues the frames.
        let first = std::future::poll_fn(|cx| Poll::Ready(p.as_mut().poll(cx))).await;
        writing.push((first, p));
    }
    let mut confirms = Vec::with_capacity(writing.len());
    for (first, p) in writing {
        let written = match first {
            Poll::Ready(r) => r,
            Poll::Pending => p.await,
        };
        confirms.push(written.map_err(Into::into)?);
    }
    Ok(confirms)
}

/// Runs `measure` up to three times: the machine and its broker are
/// shared, and another suite's broker restart must cost one sample, not
/// the whole benchmark. A retried run starts from scratch.
pub(crate) async fn attempt<T, F, Fut>(what: &str, mut measure: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut tries = 1;
    loop {
        match measure().await {
            Ok(v) => return Ok(v),
            Err(e) if tries < 3 => {
                eprintln!("bench:   {what} failed ({e:#}); retrying in 10 s");
                tries += 1;
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
            Err(e) => return Err(e.context(format!("{what}, third attempt"))),
        }
    }
}

/// How many of a sweep's fastest tunings [`sweep_best`] runs again.
const SHORTLIST: usize = 2;
/// How many more runs each of them gets.
const RERUNS: usize = 2;

/// The fastest of `tunings`, and its rate: each is run once, then the
/// [`SHORTLIST`] fastest [`RERUNS`] times more each (alternating), and
/// the winner is the one of them with the highest median. One run each let a
/// lucky or unlucky run pick the tuning that then stood as the ceiling
/// (stop 35: a reader tuning picked at 250 x 4 by one run, while
/// 1,000 x 8 measured faster than the chosen one's rounds). `rate` runs
/// one tuning; it is expected to retry a failed run itself
/// ([`attempt`]).
pub(crate) async fn sweep_best<T, F, Fut>(
    what: &str,
    tunings: &[T],
    mut rate: F,
) -> Result<(T, f64)>
where
    T: Copy + std::fmt::Display,
    F: FnMut(T) -> Fut,
    Fut: Future<Output = Result<f64>>,
{
    anyhow::ensure!(!tunings.is_empty(), "{what}: nothing to sweep");
    let mut runs: Vec<(T, Stats)> = Vec::with_capacity(tunings.len());
    for &t in tunings {
        let r = rate(t).await?;
        eprintln!("bench:   {what} {t}: {r:.0}/s");
        runs.push((t, Stats { runs: vec![r] }));
    }
    let by_median = |runs: &[(T, Stats)]| {
        let mut order: Vec<usize> = (0..runs.len()).collect();
        order.sort_by(|&a, &b| runs[b].1.median().total_cmp(&runs[a].1.median()));
        order
    };
    let shortlist: Vec<usize> = by_median(&runs).into_iter().take(SHORTLIST).collect();
    if shortlist.len() > 1 {
        for _ in 0..RERUNS {
            for &i in &shortlist {
                let r = rate(runs[i].0).await?;
                eprintln!("bench:   {what} {} again: {r:.0}/s", runs[i].0);
                runs[i].1.push(r);
            }
        }
    }
    // Only a tuning run three times can win: the single run of one left
    // out of the shortlist would otherwise beat medians of three that a
    // slow rerun pulled down (seen: 2 x 500 won on one run of 14,636/s).
    let best = by_median(&runs)
        .into_iter()
        .find(|i| shortlist.len() < 2 || shortlist.contains(i))
        .map(|i| &runs[i])
        .ok_or_else(|| anyhow::anyhow!("{what}: nothing swept"))?;
    eprintln!(
        "bench:   {what}: {} wins, median {:.0}/s [{:.0}-{:.0}]",
        best.0,
        best.1.median(),
        best.1.min(),
        best.1.max()
    );
    Ok((best.0, best.1.median()))
}

/// Median and spread of repeated runs of one figure.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stats {
    pub(crate) runs: Vec<f64>,
}

impl Stats {
    pub(crate) fn push(&mut self, v: f64) {
        self.runs.push(v);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.runs.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    pub(crate) fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    pub(crate) fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub(crate) fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }
}

/// The AMQP properties the relay gives an event of this shape (built by
/// the relay's own code), so baselines publish the same headers; callers
/// set a fresh `message_id` per message.
pub(crate) fn relay_properties() -> Result<BasicProperties> {
    let event = outbox_relay::OutboxEvent::new(
        uuid::Uuid::now_v7(),
        "order",
        "o-1",
        "OrderPlaced",
        String::new(),
    );
    event.properties().map_err(anyhow::Error::msg)
}

/// Peak resident set of a process, MiB (Linux `VmHWM`).
pub(crate) fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds (user + system) used so far by the processes whose command
/// name starts with `comm` (`postgres`, `beam.smp`), with what their
/// children that have ended used (a PostgreSQL session that closed is in
/// its postmaster's count then, so a span it ends in keeps its CPU); or
/// by `pid` itself, without its children (the bench's own children are
/// relays it measures apart).
pub(crate) fn cpu_seconds(comm: Option<&str>, pid: Option<u32>) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return f64::NAN;
    };
    let pids = dir.flatten().filter_map(|entry| {
        let p = entry.file_name().to_str()?.parse::<u32>().ok()?;
        pid.is_none_or(|want| want == p).then_some(p)
    });
    let children = comm.is_some();
    pids.filter_map(|p| stat_cpu(&format!("/proc/{p}/stat"), comm, children))
        .sum()
}

/// CPU seconds used so far by this process's threads named `name` (a
/// thread's CPU is lost once it has ended).
pub(crate) fn thread_cpu_seconds(name: &str) -> f64 {
    threads_named(name)
        .iter()
        .filter_map(|tid| stat_cpu(&format!("/proc/self/task/{tid}/stat"), None, false))
        .sum()
}

/// This process's threads named `name`, by id.
pub(crate) fn threads_named(name: &str) -> std::collections::HashSet<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Default::default();
    };
    dir.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| t.file_name().into_string().ok())
        .collect()
}

/// A channel of `conn` in confirm mode: every ceiling and raw publisher
/// publishes with confirms, as the relay does.
pub(crate) async fn confirm_channel(conn: &Connection) -> Result<lapin::Channel> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    Ok(ch)
}

/// Connects to the broker for a contender on [`on_own_runtime`] and
/// renames the IO thread lapin starts for it to [`CONTENDER_THREAD`], so
/// [`thread_cpu_seconds`] counts it as the relay process's own is
/// counted. The caller makes sure no other connection of this process
/// opens meanwhile (a latency run starts its contender once its
/// consumers are up).
pub(crate) async fn connect_contender(url: &str) -> Result<Connection> {
    const IO_THREAD: &str = "lapin-io-loop";
    let before = threads_named(IO_THREAD);
    let conn = connect(url).await?;
    let new: Vec<String> = threads_named(IO_THREAD)
        .difference(&before)
        .cloned()
        .collect();
    let renamed = new
        .iter()
        .filter(|tid| {
            std::fs::write(format!("/proc/self/task/{tid}/comm"), CONTENDER_THREAD).is_ok()
        })
        .count();
    if renamed != 1 || new.len() != 1 {
        // The run goes on; only its CPU figure for this relayer is off.
        eprintln!(
            "bench: WARNING: {renamed} of {} new broker IO threads renamed for the \
             hand-written path (1 expected): its CPU figure is not to be trusted",
            new.len()
        );
    }
    Ok(conn)
}

/// User + system CPU seconds in the `stat` file at `path`, if it exists
/// and its command name starts with `comm` (when given); with `children`,
/// also those of its children that have ended and were waited for.
fn stat_cpu(path: &str, comm: Option<&str>, children: bool) -> Option<f64> {
    let ticks = 100.0; // USER_HZ on Linux
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the parenthesised command name; it may hold spaces.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    if comm.is_some_and(|c| !stat[open + 1..close].starts_with(c)) {
        return None;
    }
    let rest: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    let utime: f64 = rest.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let stime: f64 = rest.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let ended: f64 = if children {
        // cutime and cstime.
        rest.iter()
            .skip(13)
            .take(2)
            .filter_map(|v| v.parse::<f64>().ok())
            .sum()
    } else {
        0.0
    };
    Some((utime + stime + ended) / ticks)
}

/// CPU use of the broker, the database and one more process over a span.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSpan {
    broker: f64,
    database: f64,
    client: f64,
    client_pid: u32,
}

impl CpuSpan {
    pub(crate) fn start(client_pid: u32) -> Self {
        Self {
            broker: cpu_seconds(Some("beam.smp"), None),
            database: cpu_seconds(Some("postgres"), None),
            client: cpu_seconds(None, Some(client_pid)),
            client_pid,
        }
    }

    /// (broker, database, client) CPU seconds since `start`.
    pub(crate) fn stop(&self) -> (f64, f64, f64) {
        (
            cpu_seconds(Some("beam.smp"), None) - self.broker,
            cpu_seconds(Some("postgres"), None) - self.database,
            cpu_seconds(None, Some(self.client_pid)) - self.client,
        )
    }
}

/// The name of every thread [`on_own_runtime`] starts, so its CPU can be
/// told from the harness's ([`thread_cpu_seconds`]).
pub(crate) const CONTENDER_THREAD: &str = "bench-contender";

/// Runs `work` in a thread of its own on a runtime of its own (two
/// workers, as the relay process has), so a hand-written contender does
/// not share the harness's threads. Its threads are named
/// [`CONTENDER_THREAD`].
pub(crate) fn on_own_runtime<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> std::thread::JoinHandle<Result<T>> {
    let run = move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(CONTENDER_THREAD)
            .enable_all()
            .build()?
            .block_on(work)
    };
    std::thread::Builder::new()
        .name(CONTENDER_THREAD.to_owned())
        .spawn(run)
        // As `std::thread::spawn`, which panics when the OS refuses a thread.
        .expect("the OS refused a thread")
}

/// Waits for a contender's thread ([`on_own_runtime`]) to end, without a blocking
/// task, so a caller's timeout leaves nothing behind that would hold the
/// runtime's shutdown.
pub(crate) async fn join<T: Send + 'static>(h: std::thread::JoinHandle<Result<T>>) -> Result<T> {
    wait_until_finished(&h).await;
    h.join()
        .map_err(|_| anyhow::anyhow!("a contender's thread panicked"))?
}

/// Returns once the thread of `h` has ended.
pub(crate) async fn wait_until_finished<T>(h: &std::thread::JoinHandle<T>) {
    while !h.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `REPEATABLE READ` transaction left open in the database of
/// `database_url` (a forgotten report): no vacuum there may remove a row
/// deleted after it began, until [`release_snapshot`].
pub(crate) async fn hold_snapshot(database_url: &str) -> Result<sqlx::PgConnection> {
    use sqlx::Connection as _;
    let mut c = sqlx::PgConnection::connect(database_url).await?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut c)
        .await?;
    Ok(c)
}

/// Ends a [`hold_snapshot`] transaction.
pub(crate) async fn release_snapshot(mut c: sqlx::PgConnection) -> Result<()> {
    sqlx::raw_sql("ROLLBACK").execute(&mut c).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// User and system time are read after the command name, which may
    /// hold spaces and parentheses; a filter on the name applies.
    #[test]
    fn a_stat_file_is_read_past_its_command_name() {
        let path = std::env::temp_dir().join(format!("bench-stat-{}", std::process::id()));
        // utime 250 and stime 50 ticks (fields 14 and 15 of the line),
        // cutime and cstime 8 each.
        let line = "42 (tokio (rt) 1) S 1 2 3 4 5 6 7 8 9 10 250 50 8 8 20 0";
        std::fs::write(&path, line).expect("write");
        let path = path.to_str().expect("path");
        assert_eq!(stat_cpu(path, None, false), Some(3.0));
        assert_eq!(stat_cpu(path, Some("tokio"), false), Some(3.0));
        // With the ended children's 8 + 8 ticks.
        assert_eq!(stat_cpu(path, Some("tokio"), true), Some(3.16));
        assert_eq!(stat_cpu(path, Some("postgres"), false), None);
        std::fs::remove_file(path).expect("remove");
        assert_eq!(stat_cpu(path, None, false), None);
    }

    /// A named thread is found by its name, and the CPU it spins is
    /// counted for it (and not for another name).
    #[test]
    fn a_named_threads_cpu_is_counted() {
        const NAME: &str = "bench-cpu-test";
        let spinner = std::thread::Builder::new().name(NAME.to_owned()).spawn(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            let mut x = 0u64;
            while thread_cpu_seconds(NAME) < 0.05 && std::time::Instant::now() < deadline {
                for i in 0..100_000u64 {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                }
            }
            (threads_named(NAME).len(), thread_cpu_seconds(NAME))
        });
        let (found, cpu) = spinner.expect("thread").join().expect("join");
        assert_eq!(found, 1);
        assert!(cpu >= 0.05, "{cpu} s counted");
        assert_eq!(thread_cpu_seconds("bench-no-such"), 0.0);
    }

    /// A tuning left out of the shortlist cannot win on its one run
    /// against shortlisted ones whose reruns came back slower.
    #[test]
    fn only_a_shortlisted_tuning_wins() {
        // First runs: 1 and 2 are the shortlist; their reruns are slow.
        let script = RefCell::new(HashMap::from([
            (1, vec![100.0, 50.0, 50.0]),
            (2, vec![99.0, 60.0, 60.0]),
            (3, vec![98.0]),
        ]));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let picked = rt.block_on(sweep_best("test", &[1, 2, 3], |t: i32| {
            let r = script.borrow_mut().get_mut(&t).map(|runs| runs.remove(0));
            async move { r.ok_or_else(|| anyhow::anyhow!("no run scripted")) }
        }));
        assert_eq!(picked.expect("sweep"), (2, 60.0));
    }
}
