//! A worker: its own channel, claiming batches until told to stop. One
//! batch ([`Relay::run_once`]) is claim → publish → settle in one database
//! transaction.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::FutureExt;
use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::message::ClaimedEvent;
use crate::publish::{self, Publisher, Receipt};
use crate::quarantine::MarkOnPanic;
use crate::relay::{BatchReport, BrokerSession, Relay, publish_phase};
use crate::settle::{Settled, settle};
use crate::wake::sleep_or_cancel;
use outbox_core::backoff::jittered;

impl Relay {
    /// Claims one batch, publishes it with pipelined confirms and settles
    /// it, in one database transaction. Events are removed only after their
    /// confirm; on a broker failure the transaction rolls back and the
    /// events stay for the next attempt (not counted against them).
    pub async fn run_once(&self, session: &mut BrokerSession) -> Result<BatchReport> {
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
        self.lease_round().await;
        let mut tx = inner.pool.begin_with(inner.begin.clone()).await?;
        let events = self.claim(&mut tx, session).await?;
        if events.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let events = self.isolate_suspect(events);
        if events.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        session.in_flight = events.iter().map(|e| e.id).collect();
        // Declared after `tx`, so dropped before it: should the batch
        // panic, its events are marked before the rollback unlocks them
        // for other workers.
        let on_panic = MarkOnPanic {
            relay: inner,
            ids: session.in_flight.clone(),
        };
        let deadline = tokio::time::Instant::now() + publish_phase(cfg);
        let receipts = session
            .publisher
            .publish_batch(
                &events,
                &cfg.default_exchange,
                cfg.max_payload_bytes,
                cfg.confirm_timeout,
                deadline,
            )
            .await?;
        let settled = settle(&mut tx, &inner.queries, cfg, &events, &receipts).await?;
        tx.commit().await?;
        // Settled: a panic from here on is not this batch's.
        drop(on_panic);
        self.clear_suspects(&session.in_flight);
        session.in_flight.clear();
        self.count(&events, &receipts, &settled);
        self.after_receipts(&mut session.publisher, &session.conn, &receipts)
            .await?;
        Ok(BatchReport {
            claimed: events.len(),
            settled,
        })
    }

    /// Metrics and logs of a settled batch.
    fn count(&self, events: &[ClaimedEvent], receipts: &[Receipt], settled: &Settled) {
        let inner = &self.inner;
        let cfg = &inner.config;
        metrics::histogram!("outbox_relay_batch_size").record(events.len() as f64);
        self.add_counts(settled.delivered, settled);
        for (e, o) in events.iter().zip(receipts) {
            if let Some(error) = o.error() {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, attempt = e.attempts + 1, error = %error, "event not delivered");
            }
        }
        if receipts.contains(&Receipt::NotSent) {
            tracing::warn!(
                not_sent = settled.not_sent,
                deadline = ?publish_phase(cfg),
                "the broker was too slow to finish the batch within its publish deadline; the rest goes in the next batch"
            );
        }
    }

    /// Adds `delivered` and what `settled` retried and dead-lettered to the
    /// relay's counters and metrics.
    pub(crate) fn add_counts(&self, delivered: usize, settled: &Settled) {
        let inner = &self.inner;
        metrics::counter!("outbox_relay_published_total").increment(delivered as u64);
        inner
            .published
            .fetch_add(delivered as u64, Ordering::Relaxed);
        metrics::counter!("outbox_relay_failed_total").increment(settled.retried as u64);
        metrics::counter!("outbox_relay_dead_lettered_total")
            .increment(settled.dead_lettered as u64);
        inner
            .dead_lettered
            .fetch_add(settled.dead_lettered as u64, Ordering::Relaxed);
    }

    /// What the receipts say about the session (a table batch's, or the
    /// log reader's): confirms that timed out or a failed channel end it
    /// (`Err`); nacks replace the channel.
    pub(crate) async fn after_receipts(
        &self,
        publisher: &mut Publisher,
        conn: &Arc<Connection>,
        receipts: &[Receipt],
    ) -> Result<()> {
        let cfg = &self.inner.config;
        if receipts.contains(&Receipt::TimedOut) {
            // Confirms may still arrive on this channel; start afresh.
            return Err(Error::BrokerTimeout {
                what: "publisher confirms",
                timeout: cfg.confirm_timeout,
            });
        }
        if let Some(Receipt::ChannelFailed(e)) = receipts
            .iter()
            .find(|o| matches!(o, Receipt::ChannelFailed(_)))
        {
            // Settled; now replace the closed channel.
            return Err(Error::ChannelClosed(e.clone()));
        }
        if receipts.contains(&Receipt::Nacked) {
            // Settled (retried later). A channel that published to a
            // quorum queue while its leader changed can go on nacking
            // every publish (seen on RabbitMQ 3.10 after a node was
            // killed) while a fresh channel is acked: replace it. Nacks
            // are otherwise rare (a full queue refusing publishes).
            publisher.close().await;
            *publisher = Publisher::open(conn, cfg.broker_timeout).await?;
        }
        Ok(())
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
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        let mut session = BrokerSession::new(conn, publisher, worker, cfg.workers);
        inner.health.broker.store(true, Ordering::Relaxed);
        inner.broker_outage.ok();
        let mut wake = inner.wake.subscribe();
        let mut db_failures = 0u32;
        while !stop.is_cancelled() {
            // Mark wake-ups seen *before* claiming: one that arrives during
            // the claim then makes the wait below return at once.
            wake.borrow_and_update();
            let batch = AssertUnwindSafe(self.run_once(&mut session))
                .catch_unwind()
                .await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(panic) => {
                    let why = publish::panic_message(&*panic);
                    drop(panic);
                    self.worker_panicked(&mut session, why).await?;
                    continue;
                }
            };
            match batch {
                Ok(report) => {
                    if db_failures > 0 {
                        inner.db_outage.ok();
                        inner.health.database.store(true, Ordering::Relaxed);
                        db_failures = 0;
                    }
                    if report.claimed > 0 {
                        // More may be due (a full batch, or commits that
                        // landed meanwhile): claim again at once.
                        continue;
                    }
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = wake.changed() => {}
                        _ = tokio::time::sleep(cfg.poll_interval) => {}
                    }
                    // An idle worker publishes nothing, so nothing else
                    // would notice a node that closed the connection (a
                    // stopped node): the session ends and fails over now,
                    // not at the next event, and readiness tells the truth.
                    if !session.publisher.is_open() {
                        session.publisher.close().await;
                        return Err(Error::ChannelClosed(
                            "the broker closed the connection while the worker was idle".to_owned(),
                        ));
                    }
                }
                Err(e) if e.is_broker() || !session.publisher.is_open() => {
                    session.publisher.close().await;
                    return Err(e);
                }
                Err(e) => {
                    inner.health.database.store(false, Ordering::Relaxed);
                    inner.db_outage.failed(&e);
                    db_failures = db_failures.saturating_add(1);
                    sleep_or_cancel(
                        jittered(cfg.reconnect_min, cfg.reconnect_max, db_failures),
                        &stop,
                    )
                    .await;
                }
            }
        }
        // Close the channel before the supervisor closes the connection.
        session.publisher.close().await;
        Ok(())
    }
}
