//! The relay handle: builds the stages from the configuration, each given
//! what it uses (`Worker`, `Maintenance`, `Supervisor`, the log's
//! `WalReader`), and answers for them (health, wake-ups, counts). How it
//! runs is in the stage files: `supervisor.rs` (connections and workers),
//! `worker.rs` (one batch), `maintenance.rs`, `claim/`, `lease.rs`,
//! `publish/`, `settle.rs`, `quarantine.rs` (batches that panic).

use std::sync::Arc;

use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker::Broker;
use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::health::Health;
#[cfg(feature = "testing")]
use crate::publish::Publisher;
use crate::stages::Stages;
use crate::stats::Stats;
use crate::supervisor::Supervisor;
use crate::wakeup::Wakeups;
use crate::wal::{ReaderConfig, WalReader};
use crate::worker::Worker;
#[cfg(feature = "testing")]
use crate::worker::{BatchReport, WorkerSession};
use outbox_core::outage::Outage;

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

/// The relay's stages and what its public methods read.
#[derive(Debug)]
struct Inner {
    /// This relay's identity in `outbox_relays` and `outbox_leases`.
    id: Uuid,
    #[cfg(feature = "testing")]
    broker_timeout: std::time::Duration,
    health: Arc<Health>,
    wakeups: Wakeups,
    broker: Arc<Broker>,
    broker_outage: Arc<Outage>,
    stats: Arc<Stats>,
    worker: Arc<Worker>,
    supervisor: Supervisor,
}

impl Relay {
    /// Testing only (feature `testing`): how often one claim starts at the
    /// claim index's beginning instead of the relay's cursor (otherwise 1
    /// to 30 s, from the last sweep's duration; docs/OPERATIONS.md, "A
    /// held xmin horizon"). A test that stretches it sees whether the
    /// cursor alone finds every event.
    #[cfg(feature = "testing")]
    pub fn set_claim_sweep(&self, every: std::time::Duration) {
        self.inner.worker.set_claim_sweep(every);
    }

    /// Validates `config` and checks the outbox schema is migrated.
    pub async fn new(pool: PgPool, config: RelayConfig) -> Result<Self> {
        let schema = config.validate()?;
        outbox::check_migrated(&pool, schema.as_str()).await?;
        let reader = match ReaderConfig::new(&config) {
            Some(reader) => Some((reader, wal_slot(&pool, &schema).await?)),
            None => None,
        };
        let id = Uuid::new_v4();
        let nodes = Broker::nodes(&config);
        let health = Arc::new(Health::new(nodes.clone()));
        let broker = Arc::new(Broker::new(&config, nodes, health.clone()));
        let broker_outage = Arc::new(Outage::new("broker", "outbox-relay"));
        let Stages {
            wakeups,
            stats,
            maintenance,
            settle,
            worker,
        } = Stages::new(
            &config,
            &schema,
            id,
            pool.clone(),
            health.clone(),
            broker_outage.clone(),
        );
        let reader = reader.map(|(reader, slot)| {
            WalReader::new(
                reader,
                &schema,
                &slot,
                &pool,
                broker.clone(),
                stats.clone(),
                wakeups.clone(),
                settle,
            )
        });
        let supervisor = Supervisor::new(
            &config,
            &schema,
            pool,
            broker.clone(),
            health.clone(),
            broker_outage.clone(),
            wakeups.clone(),
            worker.clone(),
            maintenance,
            reader,
        );
        Ok(Self {
            inner: Arc::new(Inner {
                id,
                #[cfg(feature = "testing")]
                broker_timeout: config.broker_timeout,
                health,
                wakeups,
                broker,
                broker_outage,
                stats,
                worker,
                supervisor,
            }),
        })
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
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        self.inner.supervisor.run(shutdown).await
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
    pub async fn run_once(&self, session: &mut WorkerSession) -> Result<BatchReport> {
        self.inner.worker.run_once(session).await
    }

    /// Readiness, shared with the HTTP endpoints.
    pub fn health(&self) -> Arc<Health> {
        self.inner.health.clone()
    }

    /// Wakes the workers now, as a NOTIFY would. For embedding services
    /// that know they just committed events.
    pub fn wake(&self) {
        self.inner.wakeups.wake();
    }

    /// Connects to a broker node (with failover, as the workers do) and
    /// closes the connection again: fails fast, naming the node, when no
    /// node takes a connection or opens a confirm-mode channel.
    /// `outbox-relay run` calls it before it starts; [`Relay::run`]
    /// itself keeps reconnecting instead.
    pub async fn check_broker(&self) -> Result<()> {
        self.inner.broker.check().await
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
        self.inner.worker.batch_statements()
    }

    #[cfg(feature = "testing")]
    async fn open_session(&self) -> Result<WorkerSession> {
        let session = self.inner.broker.connect("test session").await?;
        let publisher = Publisher::open(&session.conn, self.inner.broker_timeout).await?;
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
        self.inner.worker.panics()
    }

    /// Whether the broker is currently considered down.
    pub fn broker_down_now(&self) -> bool {
        self.inner.broker_outage.is_down()
    }
}

/// The replication slot the capture of `schema` reads; fails at start, not
/// in the background, when there is none or it cannot be read.
async fn wal_slot(pool: &PgPool, schema: &Ident) -> Result<String> {
    let Some(slot) = crate::wal::recorded_wal_slot(pool, schema).await? else {
        return Err(Error::WalRefused(format!(
            "the write-ahead-log capture is not set up for schema {schema}: no replication slot is recorded; run `outbox-relay migrate --capture wal`"
        )));
    };
    let row = crate::wal::slot_row(pool, &slot).await?;
    if let Some(e) = crate::wal::refusal(&slot, row.as_ref()) {
        return Err(e);
    }
    Ok(slot)
}
