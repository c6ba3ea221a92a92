//! A worker: its own channel, claiming batches until told to stop. One
//! batch (`Relay::run_once`) is claim → publish → settle in one database
//! transaction.
//!
//! A worker holds its database connection from one batch to the next
//! while it finds work, as the hand-written loop the bench measures it
//! against does: taking it from the pool for each batch cost sqlx's test of
//! every connection given back (a ping: a round trip, and a statement for
//! PostgreSQL, per batch). It keeps the connection through a wait for
//! work that a wake-up ends, and gives it back when a claim finds nothing
//! after a wait that the poll interval ended (a quiet spell: an idle relay
//! holds no connection of a pool it may share), after a failed batch (the
//! pool tests it and drops a dead one), and after [`HOLD_AT_MOST`], so the
//! pool's lifetime limits still apply. While events trickle in, each one
//! is followed by a claim that finds nothing: giving the connection back
//! there cost a ping per event, 8% of the relay process's CPU per event at
//! 500 events/s, and CPU spent on shared cores slows every thread's
//! wake-up, the hand-written path's too (BENCHMARKS.md, twelfth part).

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use lapin::Connection;
use outbox::Ident;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, SqlStr};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker::{blocked_now, unblocked};
use crate::claim::floor::Floor;
use crate::claim::ordered::Ordered;
use crate::claim::{ClaimState, Claims};
use crate::config::RelayConfig;
use crate::db::{bounded, discard};
use crate::error::{Error, Result};
use crate::health::Health;
use crate::lease::Leases;
use crate::maintenance::Maintenance;
use crate::message::OutboxEvent;
use crate::mutex::lock;
use crate::publish::{self, PublishSettings, Publisher, Receipt};
use crate::quarantine::Quarantine;
use crate::settle::{Settle, Settled};
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use outbox_core::amqp::BrokerError;
use outbox_core::backoff::Backoff;
use outbox_core::backoff::sleep_or_cancel;
use outbox_core::outage::Outage;

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// How they were settled.
    pub settled: Settled,
}

/// What one worker holds while it runs (and what `Relay::run_once`
/// takes): its broker connection and confirm-mode channel, its database
/// connection, its share of the partitions, and its claim state (cursors
/// over ordered aggregates).
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct WorkerSession {
    conn: Arc<Connection>,
    publisher: Publisher,
    /// Its share of the partitions and where its ordered claims resume.
    claim: ClaimState,
    /// The ids of the batch being published (for a panic report).
    in_flight: Vec<Uuid>,
    /// The database connection its batches run on, held between batches
    /// (the module's docs say why), and when it was taken from the pool.
    db: Option<(PoolConnection<Postgres>, std::time::Instant)>,
}

impl std::fmt::Debug for WorkerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSession").finish_non_exhaustive()
    }
}

#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
impl WorkerSession {
    /// Worker `worker` of `workers`, publishing on `publisher`.
    pub(crate) fn new(
        conn: Arc<Connection>,
        publisher: Publisher,
        worker: usize,
        workers: usize,
    ) -> Self {
        Self {
            conn,
            publisher,
            claim: ClaimState::new(worker, workers),
            in_flight: Vec::new(),
            db: None,
        }
    }

    /// Its broker connection.
    pub(crate) fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Gives its held database connection back to the pool.
    pub(crate) fn release_db(&mut self) {
        self.db = None;
    }

    /// Swaps its claim state with `claim` (a fleet worker serves many
    /// tenants' shares in turn, each with a claim state of its own).
    pub(crate) fn swap_claim(&mut self, claim: &mut ClaimState) {
        std::mem::swap(&mut self.claim, claim);
    }

    /// Its channel is open.
    pub(crate) fn publisher_open(&self) -> bool {
        self.publisher.is_open()
    }

    /// Closes its channel.
    pub(crate) async fn close_publisher(&self) {
        self.publisher.close().await;
    }

    /// Testing only (feature `testing`): the session's next claim is the
    /// full one (`claim/batch.sql`: its last claim's probe found ordered
    /// events, or it made none yet), not the unordered events' alone.
    #[cfg(feature = "testing")]
    pub fn claims_ordered(&self) -> bool {
        self.claim.claims_ordered()
    }

    /// Testing only (feature `testing`): closes the connection (bounded by
    /// `timeout`).
    #[cfg(feature = "testing")]
    pub async fn close(self, timeout: std::time::Duration) {
        self.publisher.close().await;
        let _ = tokio::time::timeout(timeout, self.conn.close(200, "session closed".into())).await;
    }
}

/// The table's workers: what each worker task runs (claim → publish →
/// settle in one transaction, and the loop around it). One per relay,
/// shared by its worker tasks; everything it uses is given to [`new`](Self::new).
pub(crate) struct Worker {
    pool: PgPool,
    publish: PublishSettings,
    database_timeout: Duration,
    poll_interval: Duration,
    /// The backoff's bounds after a failed batch.
    reconnect: (Duration, Duration),
    /// How many worker tasks share the partitions.
    workers: usize,
    /// The batch transaction's BEGIN with its settings.
    begin: SqlStr,
    claims: Claims,
    /// Below which no unordered event can still be claimed.
    floor: Arc<Floor>,
    leases: Arc<Leases>,
    settle: Settle,
    /// Batches that panicked.
    quarantine: Quarantine,
    stats: Arc<Stats>,
    health: Arc<Health>,
    broker_outage: Arc<Outage>,
    db_outage: Outage,
    wakeups: Wakeups,
    /// Each worker's ordered claim state while no session holds it: a
    /// worker's next session (after the broker's return) takes it up, so
    /// its walk does not start at the index's beginning again.
    ordered: Vec<Mutex<Ordered>>,
    /// The first worker up runs the session's first round.
    maintenance: Arc<Maintenance>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// The workers of the relay `id` on `schema`, by `config`; `floor`,
    /// `leases` and `stats` are shared with the maintenance round,
    /// `health` and `broker_outage` with the supervisor, `wake` with
    /// whatever wakes the workers, `settle` with the log's reader.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: &RelayConfig,
        schema: &Ident,
        id: Uuid,
        pool: PgPool,
        floor: Arc<Floor>,
        leases: Arc<Leases>,
        stats: Arc<Stats>,
        health: Arc<Health>,
        broker_outage: Arc<Outage>,
        wakeups: Wakeups,
        maintenance: Arc<Maintenance>,
        settle: Settle,
    ) -> Self {
        Self {
            publish: PublishSettings::new(config),
            database_timeout: config.database_timeout,
            poll_interval: config.poll_interval,
            reconnect: (config.reconnect_min, config.reconnect_max),
            workers: config.workers,
            begin: begin_async_commit(config),
            claims: Claims::new(schema, id, config.batch_size),
            floor,
            leases,
            quarantine: Quarantine::new(
                pool.clone(),
                schema,
                settle.clone(),
                config.retry_base,
                config.retry_max,
            ),
            settle,
            stats,
            health,
            broker_outage,
            db_outage: Outage::new("database", "outbox-relay"),
            wakeups,
            ordered: (0..config.workers.max(1))
                .map(|_| Default::default())
                .collect(),
            maintenance,
            pool,
        }
    }

    /// How many times a worker panicked inside a batch.
    pub(crate) fn panics(&self) -> u64 {
        self.quarantine.panics()
    }

    /// Testing only (feature `testing`): see `Relay::set_claim_sweep`.
    #[cfg(feature = "testing")]
    pub(crate) fn set_claim_sweep(&self, every: Duration) {
        self.floor.set_sweep(every);
    }

    /// Testing only (feature `testing`): see `Relay::batch_statements`.
    #[cfg(feature = "testing")]
    pub(crate) fn batch_statements(&self) -> [String; 4] {
        let [batch, unordered, walk] = self.claims.sql();
        [
            self.begin.as_str().to_owned(),
            batch.to_owned(),
            unordered.to_owned(),
            walk.to_owned(),
        ]
    }

    /// Claims one batch, publishes it with pipelined confirms and settles
    /// it, in one database transaction. Events are removed only after their
    /// confirm; on a broker failure the transaction rolls back and the
    /// events stay for the next attempt (not counted against them).
    ///
    /// The maintenance round (leases, stats) runs first if it is due, as
    /// it does beside a running relay's workers.
    ///
    /// The session's database connection goes back to the pool after the
    /// batch, so a test's own statements never wait for it.
    #[cfg(feature = "testing")]
    pub(crate) async fn run_once(&self, session: &mut WorkerSession) -> Result<BatchReport> {
        self.maintenance.round().await;
        let report = self.batch(session).await;
        session.db = None;
        report
    }

    /// One batch: claim, publish, settle.
    async fn batch(&self, session: &mut WorkerSession) -> Result<BatchReport> {
        // `begin` is never raced against a timeout (a cancelled begin can
        // leak an open transaction into the pool); statement_timeout and
        // idle_in_transaction_session_timeout, set in the same round trip,
        // bound the database side.
        //
        // The settle commits without waiting for the WAL flush: losing it
        // in a database crash only means its events are published again,
        // which at-least-once allows and consumers absorb. It keeps the
        // relay's fsyncs off the producers' commit path.
        // Only this batch's ids may be blamed for a panic in it.
        session.in_flight.clear();
        let start = std::time::Instant::now();
        let t = self.database_timeout;
        let conn = held(&mut session.db, &self.pool, t).await?;
        // Where the claim starts, and the floor, before `BEGIN`: the floor
        // then lies below the transaction's `now()`, which judges what is
        // due.
        let claim_start = self.floor.start();
        let mut tx = bounded(
            "BEGIN",
            t,
            sqlx::Connection::begin_with(conn, self.begin.clone()),
        )
        .await?;
        let begun = start.elapsed();
        let events = bounded(
            "the claim",
            t,
            self.claims.claim(
                &mut tx,
                (self.leases.generation(), self.leases.mask()),
                &mut session.claim,
                (&self.floor, claim_start),
            ),
        )
        .await?;
        let claimed = start.elapsed();
        if events.is_empty() {
            bounded("COMMIT", t, tx.commit()).await?;
            trace_stages(
                start,
                &[],
                [begun, claimed, claimed, claimed, start.elapsed()],
            );
            return Ok(BatchReport::default());
        }
        let taken = events.len();
        let events = self.quarantine.isolate(events);
        // The rest stay in the outbox, unlocked at commit, where the
        // claim's cursor may have passed them: rewound once they are.
        let set_aside = events.len() < taken;
        if set_aside {
            // Their aggregates' turn comes again (claim/ordered.rs).
            session.claim.ordered.requeue_last();
        }
        if events.is_empty() {
            bounded("COMMIT", t, tx.commit()).await?;
            if set_aside {
                self.floor.rewind();
            }
            return Ok(BatchReport::default());
        }
        session.in_flight = events.iter().map(|e| e.id).collect();
        // Declared after `tx`, so dropped before it: should the batch
        // panic, its events are marked before the rollback unlocks them
        // for other workers.
        let on_panic = self.quarantine.mark_on_panic(session.in_flight.clone());
        let p = &self.publish;
        let deadline = tokio::time::Instant::now() + p.phase;
        let sent = session
            .publisher
            .send_batch(
                &events,
                &p.default_exchange,
                p.max_payload_bytes,
                p.confirm_timeout,
                deadline,
            )
            .await?;
        let handed = start.elapsed();
        let receipts = sent.receipts().await?;
        let confirmed = start.elapsed();
        let settled = bounded(
            "the settle",
            t,
            self.settle.settle(&mut tx, &events, &receipts),
        )
        .await?;
        bounded("COMMIT", t, tx.commit()).await?;
        if set_aside {
            self.floor.rewind();
        }
        if settled.delivered < events.len() {
            // Events left in the outbox (retried, held back, not sent):
            // their aggregates are claimed again, not left to the sweep.
            session.claim.ordered.requeue_last();
        }
        let committed = start.elapsed();
        // Settled: a panic from here on is not this batch's.
        drop(on_panic);
        self.quarantine.clear(&session.in_flight);
        session.in_flight.clear();
        trace_stages(
            start,
            &events,
            [begun, claimed, handed, confirmed, committed],
        );
        self.count(&events, &receipts, &settled);
        session
            .publisher
            .after_receipts(&session.conn, &receipts, p.confirm_timeout)
            .await?;
        Ok(BatchReport {
            claimed: events.len(),
            settled,
        })
    }

    /// Metrics and logs of a settled batch.
    fn count(&self, events: &[OutboxEvent], receipts: &[Receipt], settled: &Settled) {
        metrics::histogram!("outbox_relay_batch_size").record(events.len() as f64);
        self.stats.add(settled.delivered, settled);
        for (e, o) in events.iter().zip(receipts) {
            if let Some(error) = o.error() {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, attempt = e.attempts + 1, error = %error, "event not delivered");
            }
        }
        if receipts.contains(&Receipt::NotSent) {
            tracing::warn!(
                not_sent = settled.not_sent,
                deadline = ?self.publish.phase,
                "the broker was too slow to finish the batch within its publish deadline; the rest goes in the next batch"
            );
        }
    }

    /// One worker: its own channel, claiming batches until `stop`. Returns
    /// `Err` only for broker failures (the session must be rebuilt).
    pub(crate) async fn work(
        &self,
        conn: Arc<Connection>,
        worker: usize,
        stop: CancellationToken,
    ) -> Result<()> {
        // A connection the broker blocks writes nothing (lapin holds every
        // frame, a channel's open too): the channel opens once it lifts.
        if !unblocked(&conn, &stop).await {
            return Ok(());
        }
        let publisher = Publisher::open(&conn, self.publish.broker_timeout).await?;
        let mut session = WorkerSession::new(conn, publisher, worker, self.workers);
        let slot = &self.ordered[worker % self.ordered.len()];
        session.claim.ordered = std::mem::take(&mut *lock(slot));
        let worked = self.work_session(&mut session, stop).await;
        *lock(slot) = std::mem::take(&mut session.claim.ordered);
        worked
    }

    /// [`Worker::work`] on its session.
    async fn work_session(
        &self,
        session: &mut WorkerSession,
        stop: CancellationToken,
    ) -> Result<()> {
        self.health.set_broker(true);
        self.broker_outage.ok();
        // The session's first maintenance round, before the first claim
        // (the first worker up runs it; the others go on).
        self.maintenance.round().await;
        let mut wake = self.wakeups.subscribe();
        // A database that stops answering is tried again at least every
        // second (each try bounded by the database timeout), so publishing
        // resumes within about a second of the link's return.
        let mut db_backoff = Backoff::new(self.reconnect.0, self.reconnect.1.min(DB_RETRY_MAX));
        // The last wait for work ended by the poll interval, not a wake-up
        // (or there was none yet).
        let mut quiet = true;
        while !stop.is_cancelled() {
            if blocked_now(&session.conn) {
                // Publishing paused while the broker blocks it (a resource
                // alarm): no batch is claimed, none charged an attempt, and
                // the connection stays (a new one would be blocked too).
                session.db = None;
                if !unblocked(&session.conn, &stop).await {
                    break;
                }
                continue;
            }
            // Mark wake-ups seen *before* claiming: one that arrives during
            // the claim then makes the wait below return at once.
            wake.borrow_and_update();
            let began = std::time::Instant::now();
            let Some(batch) = self.guarded_batch(session).await? else {
                continue;
            };
            match batch {
                Ok(report) => {
                    if db_backoff.failures() > 0 {
                        self.db_outage.ok();
                        self.health.set_database(true);
                        db_backoff.reset();
                    }
                    if report.claimed > 0 {
                        // More may be due (a full batch, or commits that
                        // landed meanwhile): claim again at once. (Not
                        // while ordered work is merely queued: aggregates
                        // whose heads back off would be queued again by
                        // every walk, and the worker would spin.)
                        continue;
                    }
                    // An idle worker holds no database connection; one
                    // that wake-ups keep busy keeps it (see the module's
                    // docs).
                    if quiet {
                        session.db = None;
                    }
                    quiet = !self.idle(session, &mut wake, &stop).await?;
                }
                Err(e) if e.is_broker() && blocked_now(&session.conn) => {
                    // The block landed on the batch: it was rolled back,
                    // no attempt counted; the loop waits for the lift.
                    tracing::debug!(error = %e, "batch rolled back: the broker blocks publishing");
                }
                Err(e) if e.is_broker() || !session.publisher.is_open() => {
                    session.publisher.close().await;
                    return Err(e);
                }
                Err(e) => {
                    // A failure of a batch begun before another worker
                    // saw the database back is of the outage that ended:
                    // /readyz does not go down again for it.
                    if self.db_outage.failed_since(began, &e) {
                        self.health.set_database(false);
                    }
                    sleep_or_cancel(db_backoff.next_delay(), &stop).await;
                }
            }
        }
        // Close the channel before the supervisor closes the connection.
        session.publisher.close().await;
        Ok(())
    }

    /// One batch on `session` (a fleet worker's turn on one tenant): see
    /// [`Worker::guarded_batch`].
    pub(crate) async fn turn(
        &self,
        session: &mut WorkerSession,
    ) -> Result<Option<Result<BatchReport>>> {
        self.guarded_batch(session).await
    }

    /// One batch, a panic in it caught: then its events are quarantined,
    /// the channel (which may hold half a batch) is replaced and `None`
    /// returned.
    async fn guarded_batch(
        &self,
        session: &mut WorkerSession,
    ) -> Result<Option<Result<BatchReport>>> {
        let batch = AssertUnwindSafe(self.batch(session)).catch_unwind().await;
        if !session.in_flight.is_empty() && !matches!(batch, Ok(Ok(_))) {
            // Its rows are back in the outbox where other workers'
            // cursors may have passed them while they were locked.
            self.floor.rewind();
            session.claim.ordered.requeue_last();
        }
        if let Some((conn, _)) = session.db.take_if(|_| !matches!(batch, Ok(Ok(_)))) {
            // Its connection may be silent or mid-transaction. After the
            // broker failed, the database answered: the pool tests it
            // (bounded, with [`crate::pool_options`]) and the rollback
            // goes out. After a database failure or a panic, it is closed
            // instead (the server rolls back): one that stopped answering
            // would hold a pool slot for as long as the kernel retries.
            if matches!(&batch, Ok(Err(e)) if e.is_broker()) {
                drop(conn);
            } else {
                discard(conn);
            }
        }
        match batch {
            Ok(batch) => Ok(Some(batch)),
            Err(panic) => {
                let why = publish::panic_message(&*panic);
                drop(panic);
                let ids = std::mem::take(&mut session.in_flight);
                self.quarantine.panicked(&ids, &why).await;
                session.publisher.close().await;
                session.publisher =
                    Publisher::open(&session.conn, self.publish.broker_timeout).await?;
                Ok(None)
            }
        }
    }

    /// Nothing was due: waits for a wake-up, the poll interval or `stop`,
    /// and says whether a wake-up ended the wait. An idle worker publishes
    /// nothing, so nothing else would notice a node that closed the
    /// connection (a stopped node): then the session ends and fails over
    /// now, not at the next event, and readiness tells the truth.
    async fn idle(
        &self,
        session: &mut WorkerSession,
        wake: &mut watch::Receiver<u64>,
        stop: &CancellationToken,
    ) -> Result<bool> {
        let woken = tokio::select! {
            _ = stop.cancelled() => false,
            changed = wake.changed() => changed.is_ok(),
            _ = tokio::time::sleep(self.poll_interval) => false,
        };
        if !session.publisher.is_open() {
            session.publisher.close().await;
            return Err(Error::Broker(BrokerError::ChannelClosed(
                "the broker closed the connection while the worker was idle".to_owned(),
            )));
        }
        Ok(woken)
    }
}

/// One batch's stages, traced at `TRACE` on the target
/// `outbox_relay::stages` (off unless asked for, e.g.
/// `RUST_LOG=warn,outbox_relay::stages=trace`): when it started
/// (microseconds since the Unix epoch), when its `BEGIN` and its claim
/// returned, its messages were handed to the broker connection, its
/// confirms were in and it committed (microseconds after its start), and
/// the ids it moved (none for an empty claim). The bench's
/// `--latency-stages` lines these up with each event's commit and arrival
/// to show where an event's latency goes.
fn trace_stages(start: std::time::Instant, events: &[OutboxEvent], at: [std::time::Duration; 5]) {
    if !tracing::enabled!(target: "outbox_relay::stages", tracing::Level::TRACE) {
        return;
    }
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_sub(start.elapsed());
    let us = |d: std::time::Duration| d.as_micros() as u64;
    let ids = events
        .iter()
        .map(|e| e.id.to_string())
        .collect::<Vec<_>>()
        .join(",");
    tracing::trace!(
        target: "outbox_relay::stages",
        start_us = us(since_epoch),
        begun_us = us(at[0]),
        claimed_us = us(at[1]),
        handed_us = us(at[2]),
        confirmed_us = us(at[3]),
        committed_us = us(at[4]),
        ids,
        "batch"
    );
}

/// One round trip: a transaction whose commit does not wait for the flush,
/// with bounds on every statement (the relay's database timeout: the
/// server gives up on a statement when the relay does) and on idling
/// inside it, whatever pool an embedding service hands in (a frozen relay
/// loses its row locks).
///
/// The idle bound is the longest a healthy batch waits inside its
/// transaction (publishing, then the confirms) plus a margin: a relay
/// frozen longer loses its session, its row locks and its partitions'
/// lease locks, so other relays can go on.
///
/// Sequential and bitmap scans are off for the batch's statements, which
/// find their rows through the outbox's indexes, the claim by walking its
/// index in order from its cursor. Before the outbox was analysed (a
/// fresh backlog), PostgreSQL's custom plans for a claim's first runs
/// read every entry from the cursor to now through a bitmap and sorted
/// them: 18,000 entries for a batch of 500 (relay-ops/tests/horizon.rs).
/// After five runs PostgreSQL may switch a prepared statement to one
/// generic plan, made with the table's size at
/// that moment: a relay that started on an empty outbox kept a plan that
/// read the whole heap, dead rows included, on every claim (twice: the
/// probe for ordered events and the unordered claim), until something
/// invalidated it (an autovacuum or analyze, which may find the table
/// empty again). JIT is off for an embedding service's own pool (the
/// binary's connections already turn it off): up to PostgreSQL 17, a
/// statement left without an index path costs a disabled plan's price and
/// would be compiled for it.
fn begin_async_commit(config: &RelayConfig) -> sqlx::SqlStr {
    let idle = config.publish_phase() + std::time::Duration::from_secs(5);
    // `SET` takes no bind parameters: the two durations are the relay's
    // own numbers.
    outbox_core::sql::Template::unqualified(
        "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL statement_timeout = '{statement_ms}ms'; \
         SET LOCAL idle_in_transaction_session_timeout = '{idle_ms}ms'; \
         SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off",
    )
    .with("statement_ms", config.database_timeout.as_millis().to_string())
    .with("idle_ms", idle.as_millis().to_string())
    .render()
}

/// The longest pause between a worker's tries of a database that failed.
const DB_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a worker holds one database connection before it gives it back
/// to the pool and takes one again.
pub(crate) const HOLD_AT_MOST: std::time::Duration = std::time::Duration::from_secs(60);

/// The worker's database connection: the one it holds, or (none held, or
/// held for [`HOLD_AT_MOST`]) one from the pool (within `timeout`), then
/// held.
async fn held<'a>(
    db: &'a mut Option<(PoolConnection<Postgres>, std::time::Instant)>,
    pool: &PgPool,
    timeout: std::time::Duration,
) -> Result<&'a mut PgConnection> {
    if db
        .as_ref()
        .is_some_and(|(_, since)| since.elapsed() >= HOLD_AT_MOST)
    {
        *db = None;
    }
    let conn = match db.take() {
        Some(conn) => conn,
        None => (
            bounded("a connection from the pool", timeout, pool.acquire()).await?,
            std::time::Instant::now(),
        ),
    };
    Ok(&mut db.insert(conn).0)
}
