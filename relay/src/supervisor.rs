//! The supervisor: what `Relay::run` runs. It keeps a broker connection
//! (reconnecting with backoff, failing over between nodes), runs the
//! workers and the maintenance round on it, and on shutdown drains the
//! batches in flight; beside it, the log's reader when the relay has one.

use std::sync::Arc;
use std::time::Duration;

use outbox::Ident;
use sqlx::PgPool;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, BrokerSession};
use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::maintenance::Maintenance;
use crate::publish;
use crate::wakeup::{Wakeups, listen};
use crate::wal::WalReader;
use crate::worker::Worker;
use outbox_core::backoff::Backoff;
use outbox_core::backoff::sleep_or_cancel;
use outbox_core::outage::Outage;

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

/// The relay's supervisor; everything it uses is given to
/// [`new`](Self::new).
pub(crate) struct Supervisor {
    pool: PgPool,
    /// Whose wake-ups it listens for.
    schema: Ident,
    settings: Settings,
    broker: Arc<Broker>,
    health: Arc<Health>,
    broker_outage: Arc<Outage>,
    wakeups: Wakeups,
    worker: Arc<Worker>,
    maintenance: Arc<Maintenance>,
    /// The log's reader, with `RelayConfig::wal`.
    reader: Option<WalReader>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("schema", &self.schema)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// What the supervisor takes of the relay's configuration.
#[derive(Debug, Clone, Copy)]
struct Settings {
    /// LISTEN for producers' wake-ups.
    listen: bool,
    workers: usize,
    database_timeout: Duration,
    broker_timeout: Duration,
    drain_timeout: Duration,
    /// The backoff's bounds between broker sessions.
    reconnect: (Duration, Duration),
}

impl Supervisor {
    /// The supervisor of `worker` and `maintenance`, by `config`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: &RelayConfig,
        schema: &Ident,
        pool: PgPool,
        broker: Arc<Broker>,
        health: Arc<Health>,
        broker_outage: Arc<Outage>,
        wakeups: Wakeups,
        worker: Arc<Worker>,
        maintenance: Arc<Maintenance>,
        reader: Option<WalReader>,
    ) -> Self {
        Self {
            pool,
            schema: schema.clone(),
            settings: Settings {
                listen: config.listen,
                workers: config.workers,
                database_timeout: config.database_timeout,
                broker_timeout: config.broker_timeout,
                drain_timeout: config.drain_timeout,
                reconnect: (config.reconnect_min, config.reconnect_max),
            },
            broker,
            health,
            broker_outage,
            wakeups,
            worker,
            maintenance,
            reader,
        }
    }

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
    pub(crate) async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let Some(reader) = &self.reader else {
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
        let cfg = self.settings;
        let mut listener = None;
        if cfg.listen {
            listener = Some(tokio::spawn(listen(
                self.pool.clone(),
                outbox::wakeup_channel(&self.schema),
                self.wakeups.clone(),
                shutdown.clone(),
                cfg.database_timeout,
            )));
        }
        self.health.set_database(true);
        let mut backoff = Backoff::new(cfg.reconnect.0, cfg.reconnect.1);
        let mut drained_late = false;
        while !shutdown.is_cancelled() {
            let session = match self.broker.connect("table workers").await {
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
                    self.broker.leave(node);
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
        self.maintenance.release_leases().await;
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
        let cfg = self.settings;
        let conn = session.conn.clone();
        let mut workers = JoinSet::new();
        let session_stop = shutdown.child_token();
        // Leases and stats beside the workers, while the session lasts: a
        // relay without a broker lets its partitions go to others. (The
        // first round is the first worker's, once its channel is open.)
        // And the claims' floor, read from the lock table; and, with
        // --archive, the archive's days.
        workers.spawn({
            let maintenance = self.maintenance.clone();
            let stop = session_stop.clone();
            async move {
                maintenance.run(stop).await;
                Ok(())
            }
        });
        for i in 0..cfg.workers {
            let worker = self.worker.clone();
            let conn = conn.clone();
            let stop = session_stop.clone();
            workers.spawn(async move { worker.work(conn, i, stop).await });
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
        self.health.set_broker(false);
        self.broker.gone();
        end
    }

    /// Stops for an error no retry can fix (a refused login, a missing
    /// virtual host, a conflicting declaration): returned from `run`, not
    /// logged as an outage for ever.
    async fn give_up(&self, e: Error, listener: Option<tokio::task::JoinHandle<()>>) -> Result<()> {
        if let Some(l) = listener {
            l.abort();
        }
        self.health.set_broker(false);
        self.maintenance.release_leases().await;
        Err(e)
    }

    async fn broker_down(&self, e: &Error, backoff: &mut Backoff, shutdown: &CancellationToken) {
        self.health.set_broker(false);
        self.broker_outage.failed(e);
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
