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

use outbox_core::amqp::BrokerError;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::FutureExt;
use lapin::Connection;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio_util::sync::CancellationToken;

use crate::db::{bounded, discard};
use crate::error::{Error, Result};
use crate::health::lock;
use crate::message::OutboxEvent;
use crate::publish::{self, Publisher, Receipt};
use crate::relay::{BatchReport, Relay, WorkerSession};
use crate::settle::{Settled, settle};
use crate::wake::sleep_or_cancel;
use outbox_core::backoff::Backoff;

impl Relay {
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
    pub async fn run_once(&self, session: &mut WorkerSession) -> Result<BatchReport> {
        self.maintenance_round().await;
        let report = self.batch(session).await;
        session.db = None;
        report
    }

    /// One batch: claim, publish, settle.
    async fn batch(&self, session: &mut WorkerSession) -> Result<BatchReport> {
        let inner = &self.inner;
        let cfg = &inner.config;
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
        let t = cfg.database_timeout;
        let conn = held(&mut session.db, &inner.pool, t).await?;
        // Where the claim starts, and the floor, before `BEGIN`: the floor
        // then lies below the transaction's `now()`, which judges what is
        // due.
        let claim_start = inner.floor.start();
        let mut tx = bounded(
            "BEGIN",
            t,
            sqlx::Connection::begin_with(conn, inner.begin.clone()),
        )
        .await?;
        let begun = start.elapsed();
        let events = bounded(
            "the claim",
            t,
            inner.claims.claim(
                &mut tx,
                (inner.leases.generation(), inner.leases.mask()),
                &mut session.claim,
                (&inner.floor, claim_start),
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
        let events = inner.quarantine.isolate(events);
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
                inner.floor.rewind();
            }
            return Ok(BatchReport::default());
        }
        session.in_flight = events.iter().map(|e| e.id).collect();
        // Declared after `tx`, so dropped before it: should the batch
        // panic, its events are marked before the rollback unlocks them
        // for other workers.
        let on_panic = inner.quarantine.mark_on_panic(session.in_flight.clone());
        let deadline = tokio::time::Instant::now() + cfg.publish_phase();
        let sent = session
            .publisher
            .send_batch(
                &events,
                &cfg.default_exchange,
                cfg.max_payload_bytes,
                cfg.confirm_timeout,
                deadline,
            )
            .await?;
        let handed = start.elapsed();
        let receipts = sent.receipts().await?;
        let confirmed = start.elapsed();
        let settled = bounded(
            "the settle",
            t,
            settle(&mut tx, &inner.settle_sql, cfg, &events, &receipts),
        )
        .await?;
        bounded("COMMIT", t, tx.commit()).await?;
        if set_aside {
            inner.floor.rewind();
        }
        if settled.delivered < events.len() {
            // Events left in the outbox (retried, held back, not sent):
            // their aggregates are claimed again, not left to the sweep.
            session.claim.ordered.requeue_last();
        }
        let committed = start.elapsed();
        // Settled: a panic from here on is not this batch's.
        drop(on_panic);
        inner.quarantine.clear(&session.in_flight);
        session.in_flight.clear();
        trace_stages(
            start,
            &events,
            [begun, claimed, handed, confirmed, committed],
        );
        self.count(&events, &receipts, &settled);
        session
            .publisher
            .after_receipts(&session.conn, &receipts, cfg.confirm_timeout)
            .await?;
        Ok(BatchReport {
            claimed: events.len(),
            settled,
        })
    }

    /// Metrics and logs of a settled batch.
    fn count(&self, events: &[OutboxEvent], receipts: &[Receipt], settled: &Settled) {
        let inner = &self.inner;
        let cfg = &inner.config;
        metrics::histogram!("outbox_relay_batch_size").record(events.len() as f64);
        inner.stats.add(settled.delivered, settled);
        for (e, o) in events.iter().zip(receipts) {
            if let Some(error) = o.error() {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, attempt = e.attempts + 1, error = %error, "event not delivered");
            }
        }
        if receipts.contains(&Receipt::NotSent) {
            tracing::warn!(
                not_sent = settled.not_sent,
                deadline = ?cfg.publish_phase(),
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
        let inner = &self.inner;
        let cfg = &inner.config;
        // A connection the broker blocks writes nothing (lapin holds every
        // frame, a channel's open too): the channel opens once it lifts.
        if !unblocked(&conn, &stop).await {
            return Ok(());
        }
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        let mut session = WorkerSession::new(conn, publisher, worker, cfg.workers);
        let slot = &inner.ordered[worker % inner.ordered.len()];
        session.claim.ordered = std::mem::take(&mut *lock(slot));
        let worked = self.work_session(&mut session, stop).await;
        *lock(slot) = std::mem::take(&mut session.claim.ordered);
        worked
    }

    /// [`Relay::work`] on its session.
    async fn work_session(
        &self,
        session: &mut WorkerSession,
        stop: CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        inner.health.broker.store(true, Ordering::Relaxed);
        inner.broker_outage.ok();
        // The session's first maintenance round, before the first claim
        // (the first worker up runs it; the others go on).
        self.maintenance_round().await;
        let mut wake = inner.wake.subscribe();
        // A database that stops answering is tried again at least every
        // second (each try bounded by the database timeout), so publishing
        // resumes within about a second of the link's return.
        let mut db_backoff = Backoff::new(cfg.reconnect_min, cfg.reconnect_max.min(DB_RETRY_MAX));
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
                        inner.db_outage.ok();
                        inner.health.database.store(true, Ordering::Relaxed);
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
                    if inner.db_outage.failed_since(began, &e) {
                        inner.health.database.store(false, Ordering::Relaxed);
                    }
                    sleep_or_cancel(db_backoff.next_delay(), &stop).await;
                }
            }
        }
        // Close the channel before the supervisor closes the connection.
        session.publisher.close().await;
        Ok(())
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
            self.inner.floor.rewind();
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
                self.inner.quarantine.panicked(&ids, &why).await;
                session.publisher.close().await;
                session.publisher =
                    Publisher::open(&session.conn, self.inner.config.broker_timeout).await?;
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
        wake: &mut tokio::sync::watch::Receiver<u64>,
        stop: &CancellationToken,
    ) -> Result<bool> {
        let woken = tokio::select! {
            _ = stop.cancelled() => false,
            changed = wake.changed() => changed.is_ok(),
            _ = tokio::time::sleep(self.inner.config.poll_interval) => false,
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

/// The longest pause between a worker's tries of a database that failed.
const DB_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the broker blocks `conn`'s publishing now.
pub(crate) fn blocked_now(conn: &Connection) -> bool {
    outbox_core::amqp::is_blocked(conn)
}

/// Waits while the broker blocks `conn`; false when `stop` came first.
pub(crate) async fn unblocked(conn: &Connection, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = outbox_core::amqp::while_blocked(conn) => !stop.is_cancelled(),
    }
}

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
