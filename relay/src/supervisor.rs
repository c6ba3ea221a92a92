//! The supervisor: [`Relay::run`] keeps a broker connection (reconnecting
//! with backoff, failing over between nodes), runs the workers on it, and
//! on shutdown drains the batches in flight.

use std::sync::atomic::Ordering;

use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::broker::BrokerSession;
use crate::db::bounded;
use crate::error::{Error, Result};
use crate::publish;
use crate::relay::Relay;
use crate::wake::{listen, sleep_or_cancel};
use crate::wal::WalReader;
use outbox_core::backoff::Backoff;

/// How one broker session ended.
#[derive(Default)]
struct SessionEnd {
    /// A worker's broker failure (the first one).
    broker_error: Option<Error>,
    /// A worker failed outside a batch (a relay bug).
    worker_bug: bool,
    /// The drain timeout passed: batches in flight were abandoned.
    drained_late: bool,
}

impl Relay {
    /// Runs until `shutdown` is cancelled: listens for wake-ups, keeps a
    /// broker connection (reconnecting with backoff), and runs the
    /// configured number of workers. On shutdown, workers stop claiming,
    /// finish the batch in flight (confirm and settle) and return.
    ///
    /// With [`RelayConfig::wal`](crate::RelayConfig::wal) it also reads the
    /// schema's replication slot (or waits as its standby), on its own
    /// broker connection; the table workers run beside it, serving the
    /// events it could not deliver. A reader that cannot go on
    /// ([`Error::WalRefused`]) stops the relay with that error.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let Some(reader) = WalReader::new(
            &inner.config,
            &inner.schema,
            &inner.wal_slot,
            &inner.pool,
            inner.broker.clone(),
            inner.stats.clone(),
            inner.wake.clone(),
        ) else {
            return self.run_table(shutdown).await;
        };
        // Both in this future: dropping it drops the reader too (its
        // replication session ends and frees the slot).
        let stop = shutdown.child_token();
        let (read, table) = tokio::join!(
            async {
                let read = reader.run(stop.clone()).await;
                if read.is_err() {
                    stop.cancel();
                }
                read
            },
            async {
                let table = self.run_table(stop.clone()).await;
                stop.cancel();
                table
            }
        );
        read.and(table)
    }

    async fn run_table(&self, shutdown: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut listener = None;
        if cfg.listen {
            listener = Some(tokio::spawn(listen(
                inner.pool.clone(),
                outbox::wakeup_channel(&inner.schema),
                inner.wake.clone(),
                shutdown.clone(),
                cfg.database_timeout,
            )));
        }
        inner.health.database.store(true, Ordering::Relaxed);
        let mut backoff = Backoff::new(cfg.reconnect_min, cfg.reconnect_max);
        let mut drained_late = false;
        while !shutdown.is_cancelled() {
            let session = match self.inner.broker.connect("table workers").await {
                Ok(opened) => opened,
                Err(e) if e.is_refusal() => return self.give_up(e, listener).await,
                Err(e) => {
                    self.broker_down(&e, &mut backoff, &shutdown).await;
                    continue;
                }
            };
            let node = session.node;
            let end = self.run_session(session, &shutdown).await;
            drained_late |= end.drained_late;
            match end.broker_error {
                Some(e) if e.is_refusal() => return self.give_up(e, listener).await,
                Some(e) => {
                    self.inner.broker.leave(node);
                    self.broker_down(&e, &mut backoff, &shutdown).await;
                }
                None if end.worker_bug && !shutdown.is_cancelled() => {
                    sleep_or_cancel(backoff.next_delay(), &shutdown).await;
                }
                None => break,
            }
        }
        if let Some(l) = listener {
            l.abort();
        }
        self.release_leases().await;
        if drained_late {
            return Err(Error::DrainTimedOut(cfg.drain_timeout));
        }
        Ok(())
    }

    /// Runs the workers on `conn` until one fails, or until shutdown, when
    /// the batches in flight get `drain_timeout` to finish; past it they
    /// are abandoned (rolled back: their events stay in the outbox).
    async fn run_session(
        &self,
        session: BrokerSession,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        let cfg = &self.inner.config;
        let conn = session.conn.clone();
        let mut workers = JoinSet::new();
        let session_stop = shutdown.child_token();
        // Leases and stats beside the workers, while the session lasts: a
        // relay without a broker lets its partitions go to others. (The
        // first round is the first worker's, once its channel is open.)
        // And the claims' floor, read from the lock table; and, with
        // --archive, the archive's days.
        workers.spawn({
            let relay = self.clone();
            let stop = session_stop.clone();
            async move {
                tokio::join!(
                    relay.maintain(stop.clone()),
                    relay.track_floor(stop.clone()),
                    relay.keep_archive(stop)
                );
                Ok(())
            }
        });
        for worker in 0..cfg.workers {
            let relay = self.clone();
            let conn = conn.clone();
            let stop = session_stop.clone();
            workers.spawn(async move { relay.work(conn, worker, stop).await });
        }
        let mut end = SessionEnd::default();
        let mut drain_by: Option<tokio::time::Instant> = None;
        loop {
            let next = match drain_by {
                None => tokio::select! {
                    r = workers.join_next() => r,
                    _ = shutdown.cancelled() => {
                        drain_by = Some(tokio::time::Instant::now() + cfg.drain_timeout);
                        continue;
                    }
                },
                Some(by) => match tokio::time::timeout_at(by, workers.join_next()).await {
                    Ok(r) => r,
                    Err(_) => {
                        workers.abort_all();
                        while workers.join_next().await.is_some() {}
                        end.drained_late = true;
                        break;
                    }
                },
            };
            let Some(r) = next else { break };
            if worker_ended(r, &mut end) {
                // One worker's failure ends the session.
                session_stop.cancel();
            }
        }
        // Past the drain timeout nothing more is waited for: the
        // connection is cut, not closed politely. Either way it is gone
        // before the next one opens (one a blocked broker holds cannot
        // send its close: it is cut too).
        drop(conn);
        if end.drained_late {
            session.abort();
        } else {
            session.close(cfg.broker_timeout).await;
        }
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.inner.broker.gone();
        end
    }

    /// Stops for an error no retry can fix (a refused login, a missing
    /// virtual host, a conflicting declaration): returned from `run`, not
    /// logged as an outage for ever.
    async fn give_up(&self, e: Error, listener: Option<tokio::task::JoinHandle<()>>) -> Result<()> {
        if let Some(l) = listener {
            l.abort();
        }
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.release_leases().await;
        Err(e)
    }

    /// Gives this relay's partition leases up (bounded: they expire by
    /// themselves when the database does not answer).
    async fn release_leases(&self) {
        let inner = &self.inner;
        let release = async {
            inner.leases.release(&inner.pool).await;
            Ok::<_, Error>(())
        };
        if let Err(e) = bounded(
            "the leases' release",
            inner.config.database_timeout,
            release,
        )
        .await
        {
            tracing::warn!(error = %e, "could not release partition leases; they expire by themselves");
        }
    }

    async fn broker_down(&self, e: &Error, backoff: &mut Backoff, shutdown: &CancellationToken) {
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.inner.broker_outage.failed(e);
        sleep_or_cancel(backoff.next_delay(), shutdown).await;
    }
}

/// Notes how a worker ended in `end`; true when that ends the session (a
/// broker failure, or a failure outside a batch).
fn worker_ended(r: std::result::Result<Result<()>, JoinError>, end: &mut SessionEnd) -> bool {
    match r {
        Ok(Ok(())) => false,
        Ok(Err(e)) => {
            end.broker_error.get_or_insert(e);
            true
        }
        Err(join) => {
            // Panics inside a batch are caught by the worker; this is one
            // outside it.
            let why = match join.try_into_panic() {
                Ok(panic) => publish::panic_message(&*panic),
                Err(join) => join.to_string(),
            };
            tracing::error!(panic = %why, "relay bug: a worker failed outside a batch; restarting the session (please report this)");
            metrics::counter!("outbox_relay_worker_panics_total").increment(1);
            end.worker_bug = true;
            true
        }
    }
}
