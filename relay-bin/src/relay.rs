//! The relay handle: its configuration and shared state, health, broker
//! sessions. How it runs is in the stage files: `supervisor.rs`
//! (connections and workers), `worker.rs` (one batch), `claim/`, `lease.rs`,
//! `publish.rs`, `settle.rs`, `quarantine.rs` (batches that panic).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use lapin::Connection;
use outbox::Ident;
use sqlx::PgPool;
use tokio::sync::watch;
use uuid::Uuid;

use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::lease::Leases;
use crate::publish::Publisher;
use crate::quarantine::Quarantine;
use crate::settle::Settled;
use crate::stats::Stats;
use outbox_core::outage::Outage;

/// One round trip: a transaction whose commit does not wait for the flush,
/// with bounds on every statement and on idling inside it, whatever pool
/// an embedding service hands in (a frozen relay loses its row locks).
///
/// The idle bound is the longest a healthy batch waits inside its
/// transaction (publishing, then the confirms) plus a margin: a relay
/// frozen longer loses its session, its row locks and its partitions'
/// lease locks, so other relays can go on.
fn begin_async_commit(config: &RelayConfig) -> sqlx::SqlStr {
    let idle = publish_phase(config) + std::time::Duration::from_secs(5);
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL statement_timeout = '30s'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
        idle.as_millis()
    )))
}

/// The longest a batch's publish phase may take (exchange checks,
/// publishes and confirms together): within the transaction's idle bound,
/// so the session, its row locks and its lease fence outlive it.
pub(crate) fn publish_phase(config: &RelayConfig) -> std::time::Duration {
    config.confirm_timeout + config.broker_timeout
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// How they were settled.
    pub settled: Settled,
}

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    pub(crate) broker: AtomicBool,
    pub(crate) database: AtomicBool,
    /// `host:port` of the broker node in use (or last used).
    pub(crate) node: std::sync::Mutex<Option<String>>,
}

impl Health {
    /// `host:port` of the broker node the relay is connected to, or was
    /// last connected to.
    pub fn broker_node(&self) -> Option<String> {
        lock(&self.node).clone()
    }

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
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: RelayConfig,
    pub(crate) schema: Ident,
    /// The replication slot the write-ahead-log capture reads, as the
    /// schema records it (empty without the capture).
    pub(crate) wal_slot: String,
    pub(crate) pool: PgPool,
    pub(crate) claim_sql: crate::claim::Statements,
    pub(crate) settle_sql: crate::settle::Statements,
    pub(crate) wake: watch::Sender<u64>,
    pub(crate) health: Arc<Health>,
    pub(crate) broker_outage: Outage,
    pub(crate) db_outage: Outage,
    /// The broker's nodes (connections with failover).
    pub(crate) broker: Arc<crate::broker::Broker>,
    /// This relay's identity in `outbox_relays` and `outbox_leases`.
    pub(crate) id: Uuid,
    /// The batch transaction's BEGIN with its settings.
    pub(crate) begin: sqlx::SqlStr,
    /// Leases of ordered-event partitions (the maintenance round).
    pub(crate) leases: crate::lease::Leases,
    /// What was settled since start.
    pub(crate) stats: Arc<crate::stats::Stats>,
    /// Batches that panicked.
    pub(crate) quarantine: crate::quarantine::Quarantine,
}

/// A broker session for [`Relay::run_once`]: one connection, one
/// confirm-mode channel, and the worker's claim state.
pub struct BrokerSession {
    pub(crate) conn: Arc<Connection>,
    pub(crate) publisher: Publisher,
    /// Which share of the relay's partitions this session publishes
    /// (`partition % workers == worker`).
    pub(crate) worker: usize,
    pub(crate) workers: usize,
    /// Per partition, the last aggregate served: the next claim resumes
    /// after it (round robin over aggregates, wrapping at the end).
    pub(crate) cursors: HashMap<i32, (String, String)>,
    /// Expected events per aggregate in a claim (1 to 64): deep aggregates
    /// fill a batch with fewer heads, which costs fewer index descents per
    /// event; one-event aggregates need many heads. Learnt from each claim.
    pub(crate) chain_hint: usize,
    /// The ids of the batch being published (for a panic report).
    pub(crate) in_flight: Vec<Uuid>,
}

impl std::fmt::Debug for BrokerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerSession").finish_non_exhaustive()
    }
}

impl BrokerSession {
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
            worker,
            workers,
            cursors: HashMap::new(),
            chain_hint: 1,
            in_flight: Vec::new(),
        }
    }

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
        outbox::check_migrated(&pool, schema.as_str()).await?;
        let wal_slot = if config.wal.is_some() {
            // Fail at start, not in the background: no slot, nothing read.
            let Some(slot) = crate::admin::recorded_wal_slot(&pool, &schema).await? else {
                return Err(Error::WalRefused(format!(
                    "the write-ahead-log capture is not set up for schema {schema}: no replication slot is recorded; run `outbox-relay migrate --capture wal`"
                )));
            };
            let row = crate::wal::slot_row(&pool, &slot).await?;
            if let Some(e) = crate::wal::refusal(&slot, row.as_ref()) {
                return Err(e);
            }
            slot
        } else {
            String::new()
        };
        let (wake, _) = watch::channel(0);
        let id = Uuid::new_v4();
        let health = Arc::new(Health::default());
        let settle_sql = crate::settle::Statements::new(&schema);
        Ok(Self {
            inner: Arc::new(Inner {
                begin: begin_async_commit(&config),
                claim_sql: crate::claim::Statements::new(&schema),
                leases: Leases::new(&schema, id, &config.name, config.lease_ttl),
                stats: Arc::new(Stats::new(&schema)),
                quarantine: Quarantine::new(
                    pool.clone(),
                    &schema,
                    settle_sql.clone(),
                    config.retry_base,
                    config.retry_max,
                ),
                settle_sql,
                broker: Arc::new(crate::broker::Broker::new(&config, health.clone())),
                health,
                schema,
                config,
                wal_slot,
                pool,
                wake,
                broker_outage: Outage::new("broker", "outbox-relay"),
                db_outage: Outage::new("database", "outbox-relay"),
                id,
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
        let (conn, _) = self.inner.broker.connect().await?;
        let publisher = Publisher::open(&conn, self.inner.config.broker_timeout).await?;
        Ok(BrokerSession::new(conn, publisher, 0, 1))
    }

    /// This relay's id in `outbox_relays` and `outbox_leases`.
    pub fn id(&self) -> Uuid {
        self.inner.id
    }

    /// Events the broker confirmed and the relay settled as delivered
    /// since start (also counted in `outbox_relay_published_total`).
    pub fn published(&self) -> u64 {
        self.inner.stats.published()
    }

    /// How many times a worker panicked inside a batch (each one a relay
    /// bug, also counted in `outbox_relay_worker_panics_total`).
    pub fn worker_panics(&self) -> u64 {
        self.inner.quarantine.panics()
    }

    /// Whether the broker is currently considered down.
    pub fn broker_down_now(&self) -> bool {
        self.inner.broker_outage.is_down()
    }
}

/// A mutex's guard, whether or not a panic poisoned it (the sets it guards
/// stay consistent at every await point).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
