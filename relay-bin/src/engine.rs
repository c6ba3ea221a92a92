//! The relay: claim, publish, settle, under a supervisor that owns the
//! broker connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use lapin::Connection;
use outbox::Ident;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::{RelayConfig, backoff};
use crate::error::{Error, Result};
use crate::message::ClaimedEvent;
use crate::publish::{self, Outcome, Publisher};
use crate::queries::Queries;
use crate::settle::{Settled, settle};
use crate::wake::{listen, sleep_or_cancel};
use outbox::__private::Outage;

/// One round trip: a transaction whose commit does not wait for the flush,
/// with bounds on every statement and on idling inside it, whatever pool
/// an embedding service hands in (a frozen relay loses its row locks).
const BEGIN_ASYNC_COMMIT: &str = "BEGIN; SET LOCAL synchronous_commit = off; \
     SET LOCAL statement_timeout = '30s'; SET LOCAL idle_in_transaction_session_timeout = '60s'";

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// How they were settled.
    pub settled: Settled,
}

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    broker: AtomicBool,
    database: AtomicBool,
}

impl Health {
    /// Connected to the broker and the last database operation succeeded.
    pub fn is_ready(&self) -> bool {
        self.broker.load(Ordering::Relaxed) && self.database.load(Ordering::Relaxed)
    }
}

/// The relay engine. Embed it in a service or run it with `outbox-relay run`.
///
/// ```no_run
/// # async fn demo() -> anyhow::Result<()> {
/// use outbox_relay::{Relay, RelayConfig};
/// let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/shop").await?;
/// let relay = Relay::new(pool, RelayConfig::default()).await?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// relay.run(shutdown.clone()).await?; // until shutdown is cancelled
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RelayConfig,
    schema: Ident,
    pool: PgPool,
    queries: Queries,
    wake: watch::Sender<u64>,
    health: Arc<Health>,
    broker_outage: Outage,
    db_outage: Outage,
}

/// A broker session for [`Relay::run_once`]: one connection, one
/// confirm-mode channel.
pub struct BrokerSession {
    conn: Arc<Connection>,
    publisher: Publisher,
}

impl std::fmt::Debug for BrokerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerSession").finish_non_exhaustive()
    }
}

impl BrokerSession {
    /// Closes the connection (bounded by `timeout`).
    pub async fn close(self, timeout: std::time::Duration) {
        self.publisher.close().await;
        let _ = tokio::time::timeout(timeout, self.conn.close(200, "session closed".into())).await;
    }
}

impl Relay {
    /// Validates `config` and checks the outbox schema is migrated.
    pub async fn new(pool: PgPool, config: RelayConfig) -> Result<Self> {
        let schema = config.validate()?;
        outbox::__private::ensure_migrated(&pool, &outbox::__private::PRODUCER, &schema).await?;
        let (wake, _) = watch::channel(0);
        Ok(Self {
            inner: Arc::new(Inner {
                queries: Queries::new(&schema),
                schema,
                config,
                pool,
                wake,
                health: Arc::new(Health::default()),
                broker_outage: Outage::new("broker", "outbox-relay"),
                db_outage: Outage::new("database", "outbox-relay"),
            }),
        })
    }

    /// Readiness, shared with the HTTP endpoints.
    pub fn health(&self) -> Arc<Health> {
        self.inner.health.clone()
    }

    /// Wakes the workers now, as a NOTIFY would. For embedding services
    /// that know they just committed events.
    pub fn wake(&self) {
        self.inner.wake.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Connects to the broker, declaring the default exchange if configured.
    pub async fn connect(&self) -> Result<BrokerSession> {
        let cfg = &self.inner.config;
        let conn = Arc::new(publish::connect(&cfg.amqp_url, cfg.broker_timeout).await?);
        if let Some(kind) = &cfg.declare_exchange {
            publish::declare_exchange(&conn, &cfg.default_exchange, kind, cfg.broker_timeout)
                .await?;
        }
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        Ok(BrokerSession { conn, publisher })
    }

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
        let mut tx = inner.pool.begin_with(BEGIN_ASYNC_COMMIT).await?;
        let events: Vec<ClaimedEvent> = sqlx::query_as(inner.queries.claim.clone())
            .bind(cfg.batch_size as i64)
            .fetch_all(&mut *tx)
            .await?;
        if events.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let outcomes = session
            .publisher
            .publish_batch(
                &events,
                &cfg.default_exchange,
                cfg.max_payload_bytes,
                cfg.confirm_timeout,
            )
            .await?;
        let settled = settle(&mut tx, &inner.queries, cfg, &events, &outcomes).await?;
        tx.commit().await?;
        metrics::histogram!("outbox_relay_batch_size").record(events.len() as f64);
        metrics::counter!("outbox_relay_published_total").increment(settled.delivered as u64);
        metrics::counter!("outbox_relay_failed_total").increment(settled.retried as u64);
        metrics::counter!("outbox_relay_dead_lettered_total")
            .increment(settled.dead_lettered as u64);
        for (e, o) in events.iter().zip(&outcomes) {
            if let Some(error) = o.error() {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, attempt = e.attempts + 1, error = %error, "event not delivered");
            }
        }
        if outcomes.contains(&Outcome::TimedOut) {
            // Confirms may still arrive on this channel; start afresh.
            return Err(Error::BrokerTimeout {
                what: "publisher confirms",
                timeout: cfg.confirm_timeout,
            });
        }
        if let Some(Outcome::ChannelFailed(e)) = outcomes
            .iter()
            .find(|o| matches!(o, Outcome::ChannelFailed(_)))
        {
            // Settled; now replace the closed channel.
            return Err(Error::ChannelClosed(e.clone()));
        }
        Ok(BatchReport {
            claimed: events.len(),
            settled,
        })
    }

    /// Runs until `shutdown` is cancelled: listens for wake-ups, keeps a
    /// broker connection (reconnecting with backoff), and runs the
    /// configured number of workers. On shutdown, workers stop claiming,
    /// finish the batch in flight (confirm and settle) and return.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut listener = None;
        if cfg.listen {
            listener = Some(tokio::spawn(listen(
                inner.pool.clone(),
                outbox::wakeup_channel(&inner.schema),
                inner.wake.clone(),
                shutdown.clone(),
            )));
        }
        inner.health.database.store(true, Ordering::Relaxed);
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            let conn = match publish::connect(&cfg.amqp_url, cfg.broker_timeout).await {
                Ok(c) => Arc::new(c),
                Err(e) => {
                    self.broker_down(&e, &mut failures, &shutdown).await;
                    continue;
                }
            };
            if let Some(kind) = &cfg.declare_exchange
                && let Err(e) = publish::declare_exchange(
                    &conn,
                    &cfg.default_exchange,
                    kind,
                    cfg.broker_timeout,
                )
                .await
            {
                self.broker_down(&e, &mut failures, &shutdown).await;
                continue;
            }
            let mut workers = JoinSet::new();
            let session_stop = shutdown.child_token();
            for _ in 0..cfg.workers {
                let relay = self.clone();
                let conn = conn.clone();
                let stop = session_stop.clone();
                workers.spawn(async move { relay.work(conn, stop).await });
            }
            let mut broker_error = None;
            while let Some(r) = workers.join_next().await {
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        broker_error.get_or_insert(e);
                        // One worker's broker failure ends the session.
                        session_stop.cancel();
                    }
                    Err(join) => {
                        broker_error
                            .get_or_insert(Error::Config(format!("relay worker failed: {join}")));
                        session_stop.cancel();
                    }
                }
            }
            let _ = tokio::time::timeout(
                cfg.broker_timeout,
                conn.close(200, "relay session over".into()),
            )
            .await;
            inner.health.broker.store(false, Ordering::Relaxed);
            match broker_error {
                Some(e) => self.broker_down(&e, &mut failures, &shutdown).await,
                None => break,
            }
        }
        if let Some(l) = listener {
            l.abort();
        }
        Ok(())
    }

    async fn broker_down(&self, e: &Error, failures: &mut u32, shutdown: &CancellationToken) {
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.inner.broker_outage.failed(e);
        *failures = failures.saturating_add(1);
        let cfg = &self.inner.config;
        sleep_or_cancel(
            backoff(cfg.reconnect_min, cfg.reconnect_max, *failures),
            shutdown,
        )
        .await;
    }

    /// One worker: its own channel, claiming batches until `stop`. Returns
    /// `Err` only for broker failures (the session must be rebuilt).
    async fn work(&self, conn: Arc<Connection>, stop: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        let mut session = BrokerSession { conn, publisher };
        inner.health.broker.store(true, Ordering::Relaxed);
        inner.broker_outage.ok();
        let mut wake = inner.wake.subscribe();
        let mut db_failures = 0u32;
        while !stop.is_cancelled() {
            // Mark wake-ups seen *before* claiming: one that arrives during
            // the claim then makes the wait below return at once.
            wake.borrow_and_update();
            match self.run_once(&mut session).await {
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
                        backoff(cfg.reconnect_min, cfg.reconnect_max, db_failures),
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

    /// Whether the broker is currently considered down.
    pub fn broker_down_now(&self) -> bool {
        self.inner.broker_outage.is_down()
    }
}
