//! Test support: real PostgreSQL and RabbitMQ, one schema and one set of
//! exchange and queue names per test, and waits on conditions with
//! deadlines (never sleep-and-hope).

mod proxy;

pub use proxy::{Mode, Proxy};
pub mod cluster;
pub mod service;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::watch;

/// PostgreSQL URL of the test database.
pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// RabbitMQ URL of the test broker.
pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A short random suffix for names.
pub fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// A pool on the test database whose sessions carry `application_name`
/// (so a test can find and terminate exactly its own backends).
pub async fn pool(application_name: &str, max: u32) -> PgPool {
    let options: PgConnectOptions = database_url().parse().expect("TEST_DATABASE_URL");
    PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options.application_name(application_name))
        .await
        .expect("test database reachable (run `make services`)")
}

/// A migrated producer schema of its own.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Pool for the test's own queries.
    pub pool: PgPool,
    /// The schema (`t_<prefix>_<random>`).
    pub schema: String,
    /// How [`TestDb::produce`] writes events: a table row, or (schemas of
    /// [`TestDb::producer_wal`]) a message in the write-ahead log.
    pub capture: outbox::Capture,
}

impl TestDb {
    /// Creates and migrates a fresh schema.
    pub async fn producer(prefix: &str) -> Self {
        let schema = format!("t_{prefix}_{}", suffix());
        let pool = pool(&format!("test-{schema}"), 8).await;
        outbox::migrate(&pool, &schema).await.expect("migrate");
        Self {
            pool,
            schema,
            capture: outbox::Capture::Table,
        }
    }

    /// A migrated schema with its write-ahead-log capture set up (what
    /// `outbox-relay migrate --capture wal` creates: an empty publication
    /// and the slot `outbox_<schema>`, recorded in `outbox_wal_capture`).
    /// [`TestDb::cleanup`] drops them;
    /// slots of test schemas that no longer exist (a failed run's) are
    /// dropped first, so none holds WAL for ever.
    pub async fn producer_wal(prefix: &str) -> Self {
        let mut db = Self::producer(prefix).await;
        db.capture = outbox::Capture::Wal;
        drop_orphan_slots(&db.pool).await;
        let slot = db.slot();
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE PUBLICATION \"{slot}\"")))
            .execute(&db.pool)
            .await
            .expect("create publication");
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(&db.pool)
            .await
            .expect("create slot (make services sets wal_level = logical)");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".outbox_wal_capture (slot) VALUES ($1)",
            db.schema
        )))
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("record the slot");
        db
    }

    /// The schema's replication slot (and publication) name.
    pub fn slot(&self) -> String {
        format!("outbox_{}", self.schema)
    }

    /// The `application_name` of the session reading the schema's slot,
    /// if one does.
    pub async fn slot_reader(&self) -> Option<String> {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT a.application_name FROM pg_replication_slots s
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1",
        )
        .bind(self.slot())
        .fetch_optional(&self.pool)
        .await
        .expect("the slot's reader")
        .flatten()
    }

    /// An outbox handle on this schema writing with `capture`.
    pub async fn outbox(&self, capture: outbox::Capture) -> outbox::Outbox {
        let mut config = outbox::OutboxConfig::default();
        config.schema = self.schema.to_string();
        config.capture = capture;
        outbox::Outbox::new(&self.pool, config)
            .await
            .expect("outbox")
    }

    /// Rows in `table` of this schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".{table}",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count")
    }

    /// Commits events in the background, `per_tx` per transaction with
    /// `pace` between transactions, until `stop`; the task returns their
    /// ids. For faults that must land while events keep arriving.
    pub fn produce_until(
        &self,
        stop: tokio_util::sync::CancellationToken,
        per_tx: usize,
        pace: Duration,
    ) -> tokio::task::JoinHandle<Vec<String>> {
        let db = self.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            while !stop.is_cancelled() {
                ids.extend(db.produce(per_tx, per_tx, Duration::ZERO).await);
                tokio::time::sleep(pace).await;
            }
            ids
        })
    }

    /// Commits `n` events, `per_tx` per transaction (default wake-up; as
    /// [`TestDb::capture`] says),
    /// pausing `pace` between transactions; returns their ids in order.
    pub async fn produce(&self, n: usize, per_tx: usize, pace: Duration) -> Vec<String> {
        let ob = self.outbox(self.capture).await;
        let mut ids = Vec::with_capacity(n);
        for start in (0..n).step_by(per_tx.max(1)) {
            let events = (start..(start + per_tx).min(n)).map(|i| {
                let payload = format!("{{\"i\": {i}}}");
                outbox::NewEvent::from_json(
                    "order",
                    format!("o-{}", i % 97),
                    "OrderPlaced",
                    payload,
                )
                .expect("event")
            });
            let mut tx = self.pool.begin().await.expect("begin");
            let batch = ob.enqueue_many(&mut *tx, events).await.expect("enqueue");
            ob.commit(tx).await.expect("commit");
            ids.extend(batch.into_iter().map(|id| id.to_string()));
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        }
        ids
    }

    /// For the oracle: waits until every event committed so far has been
    /// handled (published, or put in the outbox table by the log's reader)
    /// and the outbox table is empty. The slot's confirmed position must
    /// pass the log's end as it is now.
    pub async fn drained(&self, timeout: Duration) {
        if self.capture == outbox::Capture::Wal {
            let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
                .fetch_one(&self.pool)
                .await
                .expect("current WAL position");
            wait_until(timeout, "the slot to pass the log's end", || async {
                sqlx::query_scalar::<_, bool>(
                    "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots
                     WHERE slot_name = $1",
                )
                .bind(self.slot())
                .bind(&target)
                .fetch_optional(&self.pool)
                .await
                .ok()
                .flatten()
                .unwrap_or(false)
            })
            .await;
        }
        wait_until(timeout, "the outbox to empty", || async {
            self.count("outbox").await == 0
        })
        .await;
    }

    /// Drops the schema, and its slot and publication if it has them
    /// (ending a session still reading the slot).
    pub async fn cleanup(self) {
        drop_slot(&self.pool, &self.slot()).await;
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await;
    }
}

/// Asserts that delivery `d` is event `id` as the AMQP contract says
/// (docs/AMQP_MESSAGE.md): its id, type, JSON content type, persistence,
/// `timestamp` (Unix seconds), aggregate headers, the event's own
/// `headers` untouched, and `routing_key`.
pub fn assert_contract(
    d: &lapin::message::Delivery,
    id: &str,
    event_type: &str,
    (aggregate_type, aggregate_id): (&str, &str),
    timestamp: i64,
    headers: &[(&str, &str)],
    routing_key: &str,
) {
    let p = &d.properties;
    assert_eq!(p.message_id().as_ref().unwrap().as_str(), id);
    assert_eq!(p.kind().as_ref().unwrap().as_str(), event_type);
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    assert_eq!(*p.timestamp(), Some(timestamp as u64));
    let h = p.headers().as_ref().unwrap().inner();
    assert_eq!(
        h["x-aggregate-type"],
        AMQPValue::LongString(aggregate_type.into())
    );
    assert_eq!(
        h["x-aggregate-id"],
        AMQPValue::LongString(aggregate_id.into())
    );
    for (k, v) in headers {
        assert_eq!(h[*k], AMQPValue::LongString((*v).into()), "header {k}");
    }
    assert_eq!(d.routing_key.as_str(), routing_key);
}

/// Drops replication slot `slot` (ending the session reading it) and its
/// publication.
pub async fn drop_slot(pool: &PgPool, slot: &str) {
    for _ in 0..100 {
        let active: Option<bool> =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_optional(pool)
                .await
                .unwrap_or(Some(true));
        let step = match active {
            None => break,
            Some(true) => {
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1"
            }
            Some(false) => "SELECT pg_drop_replication_slot($1)",
        };
        let _ = sqlx::query(step).bind(slot).execute(pool).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS \"{slot}\""
    )))
    .execute(pool)
    .await;
}

/// Drops the slots and publications of test schemas (`outbox_t_...`) that
/// no longer exist: a failed run's leftovers.
pub async fn drop_orphan_slots(pool: &PgPool) {
    let orphans: Vec<String> = sqlx::query_scalar(
        "SELECT s.slot_name::text FROM pg_replication_slots s
         WHERE s.slot_name LIKE 'outbox\\_t\\_%' AND NOT s.active
           AND NOT EXISTS (SELECT 1 FROM pg_namespace n WHERE 'outbox_' || n.nspname = s.slot_name)
         UNION
         SELECT p.pubname::text FROM pg_publication p
         WHERE p.pubname LIKE 'outbox\\_t\\_%'
           AND NOT EXISTS (SELECT 1 FROM pg_namespace n WHERE 'outbox_' || n.nspname = p.pubname)",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    for slot in orphans {
        drop_slot(pool, &slot).await;
    }
}

/// A topic exchange and a durable queue bound to it with `#`, named for
/// this test only.
#[derive(Debug, Clone)]
pub struct TestBroker {
    /// The exchange.
    pub exchange: String,
    /// The queue.
    pub queue: String,
}

impl TestBroker {
    /// Declares the exchange and queue (queue arguments optional).
    pub async fn new(prefix: &str, queue_args: FieldTable) -> Self {
        let s = suffix();
        let b = Self {
            exchange: format!("test.{prefix}.{s}"),
            queue: format!("test.{prefix}.{s}.q"),
        };
        let conn = connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.exchange_declare(
            b.exchange.as_str().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("exchange");
        let q = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(b.queue.as_str().into(), q, queue_args)
            .await
            .expect("queue");
        ch.queue_bind(
            b.queue.as_str().into(),
            b.exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
        let _ = conn.close(200, "ok".into()).await;
        b
    }

    /// Deletes the exchange and queue.
    pub async fn cleanup(self) {
        let conn = connect().await;
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = ch
                .exchange_delete(
                    self.exchange.as_str().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
        }
        let _ = conn.close(200, "ok".into()).await;
    }
}

/// A plain connection to the test broker.
pub async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("test broker reachable (run `make services`)")
}

/// A connection to the first of `urls` (comma-separated) that answers
/// within 5 s (a node that is booting or stopping may accept the TCP
/// connection and never answer the handshake).
pub async fn connect_any(urls: &str) -> anyhow::Result<Connection> {
    let mut last = anyhow::anyhow!("no URL");
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let connect = Connection::connect(url, ConnectionProperties::default());
        match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => last = e.into(),
            Err(_) => last = anyhow::anyhow!("no AMQP handshake within 5 s"),
        }
    }
    Err(last)
}

/// What a [`Collector`] received, keyed by message id.
#[derive(Debug, Default)]
pub struct Received {
    /// Deliveries per message id (more than one: a duplicate on the wire).
    pub counts: HashMap<String, usize>,
    /// The first delivery of each message id.
    pub first: HashMap<String, lapin::message::Delivery>,
    /// When each delivery arrived, in order.
    pub arrivals: Vec<Instant>,
}

impl Received {
    /// Duplicates seen on the wire.
    pub fn duplicates(&self) -> usize {
        self.counts.values().map(|c| c - 1).sum()
    }

    /// The longest time between two deliveries that arrived within
    /// `from..to` (including the time from `from` to the first one).
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut last = from;
        let mut longest = Duration::ZERO;
        for &at in self.arrivals.iter().filter(|&&a| a >= from && a <= to) {
            longest = longest.max(at - last);
            last = at;
        }
        longest
    }
}

type Record = Arc<dyn Fn(lapin::message::Delivery) + Send + Sync>;
type Stopper = (watch::Sender<bool>, tokio::task::JoinHandle<()>);

/// A background consumer of one queue that hands every delivery to a
/// recorder before acking it, reconnects by itself (for broker-restart
/// tests), and can drain its queue before a test judges.
#[derive(Clone)]
struct Tap {
    /// Broker URLs, comma-separated, tried in turn.
    urls: String,
    queue: String,
    record: Record,
    task: Arc<Mutex<Option<Stopper>>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("queue", &self.queue).finish()
    }
}

impl Tap {
    fn start(urls: &str, queue: &str, record: Record) -> Self {
        let t = Self {
            urls: urls.to_owned(),
            queue: queue.to_owned(),
            record,
            task: Arc::new(Mutex::new(None)),
        };
        t.resume();
        t
    }

    fn resume(&self) {
        let (stop, mut stopped) = watch::channel(false);
        let (urls, queue, record) = (self.urls.clone(), self.queue.clone(), self.record.clone());
        let task = tokio::spawn(async move {
            while !*stopped.borrow() {
                let _ = tap(&urls, &queue, &record, &mut stopped).await;
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        });
        *self.task.lock().unwrap() = Some((stop, task));
    }

    fn abort(&self) {
        if let Some((_, t)) = self.task.lock().unwrap().take() {
            t.abort();
        }
    }

    /// Stops consuming between two messages and waits until its
    /// connection is gone.
    async fn finish(&self) {
        let taken = self.task.lock().unwrap().take();
        if let Some((stop, task)) = taken {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }

    async fn drain(&self, timeout: Duration) {
        let conn = connect_any(&self.urls)
            .await
            .expect("a broker of the tap reachable");
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            wait_until(left, &format!("{} to empty", self.queue), || async {
                depth(&conn, &self.queue).await.0 == 0
            })
            .await;
            self.finish().await;
            if settled_depth(&conn, &self.queue, deadline).await == 0 {
                break;
            }
            // A message delivered but not yet recorded went back: again.
            self.resume();
        }
        let _ = conn.close(200, "ok".into()).await;
    }
}

async fn tap(
    urls: &str,
    queue: &str,
    record: &Record,
    stopped: &mut watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // Every broker await is bounded, and a lost connection is noticed
    // within a second: lapin may not wake a consumer whose node was
    // SIGKILLed or stopped, and a tap stuck on a dead connection would
    // leave its queue undrained (seen once in the cluster suite).
    let t = Duration::from_secs(5);
    let conn = connect_any(urls).await?;
    let ch = tokio::time::timeout(t, conn.create_channel()).await??;
    tokio::time::timeout(t, ch.basic_qos(500, Default::default())).await??;
    let mut consumer = tokio::time::timeout(
        t,
        ch.basic_consume(
            queue.into(),
            "tap".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await??;
    let result = loop {
        // Stops only between messages: a recorded message is always acked
        // (or its connection is lost, and its redelivery is a real copy).
        let d = tokio::select! {
            _ = stopped.changed() => break Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if conn.status().connected() && ch.status().connected() {
                    continue;
                }
                break Err(anyhow::anyhow!("tap connection lost"));
            }
            d = consumer.next() => match d {
                Some(Ok(d)) => d,
                Some(Err(e)) => break Err(e.into()),
                None => break Ok(()),
            },
        };
        let acker = d.acker.clone();
        record(d);
        match tokio::time::timeout(t, acker.ack(BasicAckOptions::default())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => break Err(e.into()),
            Err(e) => break Err(e.into()),
        }
    };
    let _ = tokio::time::timeout(t, conn.close(200, "ok".into())).await;
    result
}

/// Consumes a queue in the background, recording every message by its
/// message id.
#[derive(Debug, Clone)]
pub struct Collector {
    /// What arrived so far.
    pub received: Arc<Mutex<Received>>,
    tap: Tap,
}

impl Collector {
    /// Starts consuming `queue`.
    pub fn start(queue: &str) -> Self {
        Self::start_on(&amqp_url(), queue)
    }

    /// Starts consuming `queue` on the first of `urls` (comma-separated)
    /// that answers, reconnecting through them.
    pub fn start_on(urls: &str, queue: &str) -> Self {
        let received = Arc::new(Mutex::new(Received::default()));
        let r = received.clone();
        let record: Record = Arc::new(move |d: lapin::message::Delivery| {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let mut g = r.lock().unwrap();
            g.arrivals.push(Instant::now());
            *g.counts.entry(id.clone()).or_default() += 1;
            g.first.entry(id).or_insert(d);
        });
        Self {
            received,
            tap: Tap::start(urls, queue, record),
        }
    }

    /// Distinct message ids received.
    pub fn distinct(&self) -> usize {
        self.received.lock().unwrap().counts.len()
    }

    /// Whether `id` arrived.
    pub fn has(&self, id: &str) -> bool {
        self.received.lock().unwrap().counts.contains_key(id)
    }

    /// Duplicates seen so far.
    pub fn duplicates(&self) -> usize {
        self.received.lock().unwrap().duplicates()
    }

    /// Stops consuming at once (what it holds unacked goes back to the
    /// queue).
    pub fn stop(&self) {
        self.tap.abort();
    }

    /// Quiet before judging: consumes the queue until it holds no message,
    /// ready or unacknowledged, then stops. Call it once every publisher
    /// has stopped (a stopped relay's late copies included).
    pub async fn drain(&self, timeout: Duration) {
        self.tap.drain(timeout).await;
    }
}

/// Declares the durable `queue` (with `args`, such as a quorum type) bound
/// to `exchange` with `pattern`: a queue that sees what the relays put on
/// the wire, for a [`Collector`] or a [`SeqLog`] to record.
pub async fn declare_tap_queue(
    conn: &Connection,
    exchange: &str,
    queue: &str,
    pattern: &str,
    args: FieldTable,
) {
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), durable, args).await.unwrap();
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        pattern.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

/// (ready messages, consumers) of `queue`, from a passive declare on a
/// channel of its own; (u32::MAX, 0) while the queue cannot be read.
pub async fn depth(conn: &Connection, queue: &str) -> (u32, u32) {
    let Ok(ch) = conn.create_channel().await else {
        return (u32::MAX, 0);
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let got = match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => (q.message_count(), q.consumer_count()),
        Err(_) => (u32::MAX, 0),
    };
    let _ = ch.close(200, "ok".into()).await;
    got
}

/// The messages left in `queue` once it has no consumer: the queue
/// requeues a leaving consumer's unacknowledged messages in the same step
/// that removes it, so with no consumer the ready count is every message.
pub async fn settled_depth(conn: &Connection, queue: &str, deadline: Instant) -> u32 {
    let ready = Arc::new(Mutex::new(u32::MAX));
    let left = deadline.saturating_duration_since(Instant::now());
    wait_until(left, &format!("{queue} to lose its consumers"), || async {
        let (r, consumers) = depth(conn, queue).await;
        *ready.lock().unwrap() = r;
        consumers == 0 && r != u32::MAX
    })
    .await;
    *ready.lock().unwrap()
}

/// Waits until `check` returns true, polling every 20 ms; panics with
/// `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A child process that is SIGKILLed and reaped when dropped, so a test
/// that fails half-way leaves no process behind.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every delivery of a queue as (`x-aggregate-id`, `x-aggregate-seq`), in
/// arrival order, copies included; seq 0 for an event without a sequence.
/// Consumes and acks in the background.
#[derive(Debug, Clone)]
pub struct SeqLog {
    entries: Arc<Mutex<Vec<(String, i64)>>>,
    tap: Tap,
}

impl SeqLog {
    /// Starts consuming `queue` (which must exist).
    pub fn start(queue: &str) -> Self {
        let entries: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
        let e = entries.clone();
        let record: Record = Arc::new(move |d: lapin::message::Delivery| {
            let headers = d.properties.headers().clone().unwrap_or_default();
            let h = headers.inner();
            let id = match h.get("x-aggregate-id") {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("x-aggregate-id missing: {other:?}"),
            };
            let seq = match h.get("x-aggregate-seq") {
                Some(AMQPValue::LongLongInt(n)) => *n,
                None => 0,
                other => panic!("x-aggregate-seq of the wrong type: {other:?}"),
            };
            e.lock().unwrap().push((id, seq));
        });
        Self {
            entries,
            tap: Tap::start(&amqp_url(), queue, record),
        }
    }

    /// Quiet before judging: see [`Collector::drain`].
    pub async fn drain(&self, timeout: Duration) {
        self.tap.drain(timeout).await;
    }

    /// Deliveries so far, copies included.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    /// Whether nothing arrived yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every delivery so far, in arrival order.
    pub fn entries(&self) -> Vec<(String, i64)> {
        self.entries.lock().unwrap().clone()
    }

    /// The sequence numbers of `aggregate`'s deliveries, in arrival order.
    pub fn seqs_of(&self, aggregate: &str) -> Vec<i64> {
        self.entries
            .lock()
            .unwrap()
            .iter()
            .filter(|(a, _)| a == aggregate)
            .map(|(_, s)| *s)
            .collect()
    }

    /// Per aggregate, its sequence numbers in the order of their first
    /// arrival, and how many deliveries were copies of one seen before.
    pub fn first_arrivals(&self) -> (HashMap<String, Vec<i64>>, usize) {
        let mut seen = std::collections::HashSet::new();
        let mut first: HashMap<String, Vec<i64>> = HashMap::new();
        let mut copies = 0;
        for (a, s) in self.entries.lock().unwrap().iter() {
            if seen.insert((a.clone(), *s)) {
                first.entry(a.clone()).or_default().push(*s);
            } else {
                copies += 1;
            }
        }
        (first, copies)
    }
}

/// Rows of `table` (a quoted, schema-qualified outbox table) that some
/// transaction holds locked right now: a relay's batch in flight.
pub async fn locked_rows(pool: &PgPool, table: &str) -> i64 {
    let mut tx = pool.begin().await.expect("begin");
    let (all, free): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {table}),
                (SELECT count(*) FROM (SELECT 1 FROM {table} FOR UPDATE SKIP LOCKED) f)"
    )))
    .fetch_one(&mut *tx)
    .await
    .expect("locked rows");
    tx.rollback().await.expect("rollback");
    all - free
}

/// Freezes `child` (SIGSTOP) until a freeze catches it holding rows of
/// `table` locked (a batch in flight: claimed, not yet settled), trying at
/// most `attempts` times with a short run between tries. Returns the rows
/// it held, with the child still frozen; 0 (child running) when no freeze
/// landed inside a batch.
pub async fn freeze_mid_batch(
    child: &std::process::Child,
    pool: &PgPool,
    table: &str,
    attempts: u32,
) -> i64 {
    use nix::sys::signal::{Signal, kill};
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    for attempt in 0..attempts {
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        let locked = locked_rows(pool, table).await;
        if locked > 0 {
            return locked;
        }
        kill(pid, Signal::SIGCONT).expect("SIGCONT");
        tokio::time::sleep(Duration::from_millis(3 + u64::from(attempt * 7 % 11))).await;
    }
    0
}

/// SIGKILLs and reaps `child`.
pub fn kill_now(mut child: KillOnDrop) {
    use nix::sys::signal::{Signal, kill};
    let _ = kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGKILL,
    );
    let _ = child.wait();
}

/// Sends `signal` to `child` and waits (at most `timeout`) for it to exit;
/// returns its exit code (`None`: ended by a signal).
pub async fn stop_child(
    child: &mut KillOnDrop,
    signal: nix::sys::signal::Signal,
    timeout: Duration,
) -> Option<i32> {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal);
    wait_exit(child, timeout).await
}

/// Waits (at most `timeout`) for `child` to exit; returns its exit code
/// (`None`: ended by a signal).
pub async fn wait_exit(child: &mut KillOnDrop, timeout: Duration) -> Option<i32> {
    let mut status = None;
    wait_until(timeout, "the process to exit", || {
        let exited = child.try_wait().expect("poll");
        if exited.is_some() {
            status = exited;
        }
        std::future::ready(exited.is_some())
    })
    .await;
    status.and_then(|s| s.code())
}

/// The oracle's verdict, once everything is quiet: the effects `applied`
/// (one row per application) are exactly the `committed` event ids, none
/// applied twice. Panics naming `scenario` with what is missing, extra or
/// doubled.
pub fn assert_applied_once(applied: &[String], committed: &[String], scenario: &str) {
    let distinct: std::collections::HashSet<&String> = applied.iter().collect();
    let expected: std::collections::HashSet<&String> = committed.iter().collect();
    let missing = expected.difference(&distinct).count();
    let unexpected = distinct.difference(&expected).count();
    assert!(
        missing == 0 && unexpected == 0,
        "{scenario}: applied effects differ from committed events: {missing} committed \
         events never applied, {unexpected} effects of events never committed"
    );
    assert_eq!(
        applied.len(),
        distinct.len(),
        "{scenario}: an effect was applied twice"
    );
}

/// What [`post_json`] got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    /// The status code.
    pub status: u16,
    /// `Idempotent-Replayed: true` was set (a recorded response).
    pub replayed: bool,
    /// The body.
    pub body: String,
}

/// One `POST` of JSON `body` to `path` on `addr` under `Idempotency-Key:
/// key`, over a plain HTTP/1.1 connection, as any client would send it.
pub async fn post_json(addr: std::net::SocketAddr, path: &str, key: &str, body: &str) -> HttpReply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nIdempotency-Key: {key}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.expect("receive");
    HttpReply {
        status: raw
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line"),
        replayed: raw
            .to_ascii_lowercase()
            .contains("\r\nidempotent-replayed: true\r\n"),
        body: raw.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned(),
    }
}
