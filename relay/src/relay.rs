//! The relay handle: its configuration and shared state, health, broker
//! sessions. How it runs is in the stage files: `supervisor.rs`
//! (connections and workers), `worker.rs` (one batch), `claim/`, `lease.rs`,
//! `publish.rs`, `settle.rs`, `quarantine.rs` (batches that panic).

use std::sync::Arc;

use lapin::Connection;
use outbox::Ident;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::watch;
use uuid::Uuid;

use crate::claim::ClaimState;
use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::lease::Leases;
use crate::publish::Publisher;
use crate::quarantine::Quarantine;
use crate::settle::Settled;
use crate::stats::Stats;
use outbox_core::outage::Outage;

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
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL statement_timeout = '{}ms'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'; \
         SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off",
        config.database_timeout.as_millis(),
        idle.as_millis()
    )))
}

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
    pub(crate) claims: crate::claim::Claims,
    /// Below which no unordered event can still be claimed
    /// ([`crate::claim::floor`]).
    pub(crate) floor: crate::claim::floor::Floor,
    /// Each worker's ordered claim state while no session holds it: a
    /// worker's next session (after the broker's return) takes it up, so
    /// its walk does not start at the index's beginning again.
    pub(crate) ordered: Vec<std::sync::Mutex<crate::claim::ordered::Ordered>>,
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

/// What one worker holds while it runs (and what `Relay::run_once`
/// takes): its broker connection and confirm-mode channel, its database
/// connection, its share of the partitions, and its claim state (cursors
/// over ordered aggregates).
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct WorkerSession {
    pub(crate) conn: Arc<Connection>,
    pub(crate) publisher: Publisher,
    /// Its share of the partitions and where its ordered claims resume.
    pub(crate) claim: ClaimState,
    /// The ids of the batch being published (for a panic report).
    pub(crate) in_flight: Vec<Uuid>,
    /// The database connection its batches run on, held between batches
    /// ([`crate::worker`] says why), and when it was taken from the pool.
    pub(crate) db: Option<(PoolConnection<Postgres>, std::time::Instant)>,
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

impl Relay {
    /// Testing only (feature `testing`): how often one claim starts at the
    /// claim index's beginning instead of the relay's cursor (otherwise 1
    /// to 30 s, from the last sweep's duration; docs/OPERATIONS.md, "A
    /// held xmin horizon"). A test that stretches it sees whether the
    /// cursor alone finds every event.
    #[cfg(feature = "testing")]
    pub fn set_claim_sweep(&self, every: std::time::Duration) {
        self.inner.floor.set_sweep(every);
    }

    /// Validates `config` and checks the outbox schema is migrated.
    pub async fn new(pool: PgPool, config: RelayConfig) -> Result<Self> {
        let schema = config.validate()?;
        outbox::check_migrated(&pool, schema.as_str()).await?;
        let wal_slot = if config.wal.is_some() {
            // Fail at start, not in the background: no slot, nothing read.
            let Some(slot) = crate::wal::recorded_wal_slot(&pool, &schema).await? else {
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
        let nodes = crate::broker::Broker::nodes(&config);
        let health = Arc::new(Health::new(nodes.clone()));
        let settle_sql = crate::settle::Statements::new(&schema);
        Ok(Self {
            inner: Arc::new(Inner {
                begin: begin_async_commit(&config),
                claims: crate::claim::Claims::new(&schema, id, config.batch_size),
                floor: crate::claim::floor::Floor::new(&schema),
                ordered: (0..config.workers.max(1))
                    .map(|_| Default::default())
                    .collect(),
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
                broker: Arc::new(crate::broker::Broker::new(&config, nodes, health.clone())),
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

    /// Connects to a broker node (with failover, as the workers do) and
    /// closes the connection again: fails fast, naming the node, when no
    /// node takes a connection or opens a confirm-mode channel.
    /// `outbox-relay run` calls it before it starts; [`Relay::run`]
    /// itself keeps reconnecting instead.
    pub async fn check_broker(&self) -> Result<()> {
        let timeout = self.inner.config.broker_timeout;
        let session = self.inner.broker.connect("start-up check").await?;
        let publisher = Publisher::open(&session.conn, timeout).await;
        if let Ok(p) = &publisher {
            p.close().await;
        }
        session.close(timeout).await;
        publisher.map(drop)
    }

    /// Testing only (feature `testing`): a worker session of its own, for
    /// `Relay::run_once`; it publishes all of the relay's partitions.
    #[cfg(feature = "testing")]
    pub async fn connect(&self) -> Result<WorkerSession> {
        self.open_session().await
    }

    /// Testing only (feature `testing`): the statement that opens every
    /// batch's transaction and the claims' texts, with their parameters as
    /// each file documents them: the full claim (`claim/batch.sql`), the
    /// claim while no ordered event waits (`claim/unordered.sql`) and the
    /// walk over ordered events (`claim/walk.sql`), for tests of the
    /// claims' plans.
    #[cfg(feature = "testing")]
    pub fn batch_statements(&self) -> [String; 4] {
        let [batch, unordered, walk] = self.inner.claims.sql();
        [
            self.inner.begin.as_str().to_owned(),
            batch.to_owned(),
            unordered.to_owned(),
            walk.to_owned(),
        ]
    }

    #[cfg(feature = "testing")]
    async fn open_session(&self) -> Result<WorkerSession> {
        let session = self.inner.broker.connect("test session").await?;
        let publisher = Publisher::open(&session.conn, self.inner.config.broker_timeout).await?;
        // The test owns the connection now (its link and block watch go).
        Ok(WorkerSession::new(session.conn.clone(), publisher, 0, 1))
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
