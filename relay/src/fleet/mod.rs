//! The fleet: one relay process for many tenant schemas, in one or more
//! databases. Each database ([`site::Site`]) has one pool, one LISTEN
//! session for all its tenants, a census every few seconds (tenants join
//! and leave without a restart) and one probe per poll interval for due
//! events; one broker connection serves every tenant; `workers` tasks take
//! turns over the tenants with work ([`ready::Ready`]), one batch a turn,
//! each through the tenant's own stages ([`tenant::Tenant`]: what a
//! [`crate::Relay`] on that schema would run). An idle tenant costs its
//! share of the census and of the probe, nothing else.

mod members;
mod ready;
mod site;
mod tenant;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker::{Broker, blocked_now, unblocked};
use crate::config::RelayConfig;
use crate::error::Result;
use crate::health::Health;
use crate::publish::Publisher;
use crate::worker::WorkerSession;
pub use members::{FLEET_SCHEMA, migrate_fleet};
use outbox_core::backoff::{Backoff, sleep_or_cancel};
use outbox_core::outage::Outage;
use ready::Ready;
use site::Site;
pub use tenant::TenantHealth;

/// What a fleet serves and how.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FleetConfig {
    /// The databases, each a pool of `relay.workers + 2` connections.
    pub databases: Vec<sqlx::PgPool>,
    /// The tenants: every schema of each database that holds the outbox at
    /// this release's migration, its name `LIKE` this pattern when set.
    pub like: Option<String>,
    /// How often each database's census looks for tenants that joined or
    /// left.
    pub discover_every: Duration,
    /// Everything else, as for one relay. Its `schema` is not read, nor
    /// its `wal`: the fleet serves the outbox tables only (events written
    /// with `Capture::Wal` wait in their slots for a relay of their own).
    pub relay: RelayConfig,
}

impl FleetConfig {
    /// A fleet over `databases` with the defaults.
    pub fn new(databases: Vec<sqlx::PgPool>, relay: RelayConfig) -> Self {
        Self {
            databases,
            like: None,
            discover_every: Duration::from_secs(5),
            relay,
        }
    }
}

/// One tenant as the fleet sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TenantStatus {
    /// Which database (its place in [`FleetConfig::databases`]).
    pub database: usize,
    /// Its schema.
    pub schema: String,
    /// Events it published since the fleet started.
    pub published: u64,
    /// What became of its last batches.
    pub health: TenantHealth,
    /// Whether this fleet serves it: fleets over one database split its
    /// tenants ([`migrate_fleet`]); false when another one does.
    pub served_here: bool,
}

/// What the fleet's parts share.
pub(crate) struct Shared {
    pub(crate) config: RelayConfig,
    pub(crate) like: Option<String>,
    pub(crate) discover_every: Duration,
    pub(crate) id: Uuid,
    pub(crate) health: Arc<Health>,
    pub(crate) broker_outage: Arc<Outage>,
    pub(crate) ready: Ready,
    /// Per database: whether its last census answered. `/readyz` says the
    /// database is fine while every one did.
    databases_up: Vec<std::sync::atomic::AtomicBool>,
    /// Cancelled when the fleet stops: the tenants' upkeep ends with it.
    pub(crate) root: CancellationToken,
    /// Each tenant's upkeep holds a clone; the fleet's stop waits until
    /// every one is dropped (their leases released).
    done: std::sync::Mutex<Option<tokio::sync::mpsc::Sender<()>>>,
    all_done: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<()>>,
}

impl Shared {
    /// Database `i`'s last census answered (`up`) or not.
    pub(crate) fn database_up(&self, i: usize, up: bool) {
        use std::sync::atomic::Ordering;
        if let Some(flag) = self.databases_up.get(i) {
            flag.store(up, Ordering::Release);
        }
        let all = self.databases_up.iter().all(|f| f.load(Ordering::Acquire));
        self.health.set_database(all);
    }

    /// Queues every share of `tenant` for a turn, unless it is backing off
    /// after a failure (its own timer queues it then).
    pub(crate) fn queue(&self, tenant: &Arc<tenant::Tenant>) {
        if !tenant.backing_off() {
            self.ready.push(tenant);
        }
    }

    /// Starts `tenant`'s upkeep if it does not run, and then runs its
    /// first lease round.
    async fn activate(self: &Arc<Self>, tenant: &Arc<tenant::Tenant>) {
        let Some(done) = crate::mutex::lock(&self.done).clone() else {
            return;
        };
        let wake = {
            let (shared, tenant) = (self.clone(), tenant.clone());
            move || shared.queue(&tenant)
        };
        if tenant.activate(&self.root, done, wake) {
            tenant.round().await;
        }
    }
}

/// Many tenants, one process. See the module's docs.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<Parts>,
}

/// The fleet's databases, broker and what they share.
struct Parts {
    shared: Arc<Shared>,
    sites: Vec<Arc<Site>>,
    broker: Arc<Broker>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("databases", &self.inner.sites.len())
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// Validates `config`; the tenants are found once it runs.
    pub fn new(config: FleetConfig) -> Result<Self> {
        config.relay.validate()?;
        let nodes = Broker::nodes(&config.relay);
        let health = Arc::new(Health::new(nodes.clone()));
        let broker = Arc::new(Broker::new(&config.relay, nodes, health.clone()));
        let (done, all_done) = tokio::sync::mpsc::channel(1);
        let shared = Arc::new(Shared {
            root: CancellationToken::new(),
            done: std::sync::Mutex::new(Some(done)),
            all_done: tokio::sync::Mutex::new(all_done),
            like: config.like,
            discover_every: config.discover_every,
            id: Uuid::new_v4(),
            health,
            broker_outage: Arc::new(Outage::new("broker", "outbox-relay")),
            ready: Ready::default(),
            databases_up: config
                .databases
                .iter()
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            config: config.relay,
        });
        let sites = config
            .databases
            .into_iter()
            .enumerate()
            .map(|(i, pool)| Arc::new(Site::new(i, pool, shared.id)))
            .collect();
        Ok(Self {
            inner: Arc::new(Parts {
                shared,
                sites,
                broker,
            }),
        })
    }

    /// Readiness, shared with the HTTP endpoints: the broker connection
    /// and its blocks (a tenant's failures are its own: see
    /// [`tenants`](Self::tenants)).
    pub fn health(&self) -> Arc<Health> {
        self.inner.shared.health.clone()
    }

    /// As [`crate::Relay::check_broker`]: connects to a broker node and
    /// closes the connection again, failing fast when none answers.
    pub async fn check_broker(&self) -> Result<()> {
        self.inner.broker.check().await
    }

    /// Every tenant the last census of each database found: those served
    /// now, and those it does not serve ([`TenantHealth::NotServed`]).
    pub fn tenants(&self) -> Vec<TenantStatus> {
        let mut all = Vec::new();
        for (i, site) in self.inner.sites.iter().enumerate() {
            all.extend(site.tenants().into_iter().map(|t| TenantStatus {
                database: i,
                schema: t.schema.as_str().to_owned(),
                published: t.published(),
                health: t.health(),
                served_here: site.owns(&t),
            }));
            all.extend(
                site.refused()
                    .into_iter()
                    .map(|(schema, state)| TenantStatus {
                        database: i,
                        schema,
                        published: 0,
                        health: TenantHealth::NotServed {
                            why: state.to_string(),
                        },
                        served_here: false,
                    }),
            );
        }
        all
    }

    /// Events published since start, every tenant's.
    pub fn published(&self) -> u64 {
        self.inner
            .sites
            .iter()
            .flat_map(|s| s.tenants())
            .map(|t| t.published())
            .sum()
    }

    /// Runs until `shutdown`: each database's census, probe and listener,
    /// and the workers on one broker connection (reconnecting with
    /// backoff). On shutdown the batches in flight finish and every
    /// tenant's leases are released. Fails only for an error no retry can
    /// fix (a refused login, a missing virtual host). Runs once.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let shared = &self.inner.shared;
        let stop = shared.root.clone();
        let linked = {
            let (shutdown, stop) = (shutdown.clone(), stop.clone());
            tokio::spawn(async move {
                shutdown.cancelled().await;
                stop.cancel();
            })
        };
        let mut sites = JoinSet::new();
        for site in &self.inner.sites {
            let (site, shared, stop) = (site.clone(), shared.clone(), stop.clone());
            sites.spawn(async move { site.run(&shared, stop).await });
        }
        let result = self.supervise(&stop).await;
        stop.cancel();
        linked.abort();
        while sites.join_next().await.is_some() {}
        for site in &self.inner.sites {
            for t in site.tenants() {
                t.retire();
            }
        }
        // Every upkeep ends with the root token; wait for their releases
        // (each bounded by the database timeout).
        drop(crate::mutex::lock(&shared.done).take());
        let _ = shared.all_done.lock().await.recv().await;
        result
    }

    /// Broker sessions and their workers until `stop`.
    async fn supervise(&self, stop: &CancellationToken) -> Result<()> {
        let shared = &self.inner.shared;
        let cfg = &shared.config;
        let mut backoff = Backoff::new(cfg.reconnect_min, cfg.reconnect_max);
        while !stop.is_cancelled() {
            let session = match self.inner.broker.connect("fleet workers").await {
                Ok(s) => s,
                Err(e) if e.is_refusal() => return Err(e),
                Err(e) => {
                    shared.health.set_broker(false);
                    shared.broker_outage.failed(&e);
                    sleep_or_cancel(backoff.next_delay(), stop).await;
                    continue;
                }
            };
            shared.health.set_broker(true);
            shared.broker_outage.ok();
            let node = session.node;
            let session_stop = stop.child_token();
            let mut workers = JoinSet::new();
            for i in 0..cfg.workers.max(1) {
                let (fleet, conn, stop) =
                    (self.clone(), session.conn.clone(), session_stop.clone());
                workers.spawn(async move { fleet.work(conn, i, stop).await });
            }
            let mut failed = None;
            while let Some(r) = workers.join_next().await {
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        failed.get_or_insert(e);
                        session_stop.cancel();
                    }
                    Err(join) => {
                        tracing::error!(error = %join, "relay bug: a fleet worker failed outside a batch; restarting the session (please report this)");
                        session_stop.cancel();
                    }
                }
            }
            session.close(cfg.broker_timeout).await;
            shared.health.set_broker(false);
            self.inner.broker.gone();
            match failed {
                Some(e) if e.is_refusal() => return Err(e),
                Some(e) => {
                    self.inner.broker.leave(node);
                    shared.broker_outage.failed(&e);
                    sleep_or_cancel(backoff.next_delay(), stop).await;
                }
                None => backoff.reset(),
            }
        }
        Ok(())
    }

    /// Fleet worker `i`: its own channel, taking turns over the tenants'
    /// shares with work until `stop`. Returns `Err` only for broker
    /// failures (the session is rebuilt).
    async fn work(
        &self,
        conn: Arc<lapin::Connection>,
        i: usize,
        stop: CancellationToken,
    ) -> Result<()> {
        let shared = &self.inner.shared;
        if !unblocked(&conn, &stop).await {
            return Ok(());
        }
        let publisher = Publisher::open(&conn, shared.config.broker_timeout).await?;
        let workers = shared.config.workers.max(1);
        let mut session = WorkerSession::new(conn, publisher, i, workers);
        let mut site = usize::MAX;
        loop {
            // Nothing waits: the held connection goes back to its pool (an
            // idle fleet holds none but its listeners').
            if shared.ready.is_empty() {
                session.release_db();
            }
            let Some((tenant, share)) = shared.ready.next(&stop).await else {
                break;
            };
            let database = &self.inner.sites[tenant.site];
            if tenant.backing_off() || database.unreachable() || !database.owns(&tenant) {
                continue;
            }
            if blocked_now(session.conn()) {
                shared.ready.push_share(&tenant, share);
                session.release_db();
                if !unblocked(session.conn(), &stop).await {
                    break;
                }
                continue;
            }
            let Some(mut claim) = tenant.begin_turn(share) else {
                continue;
            };
            // A held connection is of one database's pool.
            if tenant.site != site {
                session.release_db();
                site = tenant.site;
            }
            session.swap_claim(&mut claim);
            let turn = tenant.worker.turn(&mut session).await;
            session.swap_claim(&mut claim);
            tenant.end_turn(share, claim);
            match turn {
                Ok(Some(Ok(report))) => {
                    tenant.worked(report.claimed);
                    // Its upkeep runs while it has work, or ordered events
                    // wait (they need its leases).
                    if report.claimed > 0 || tenant.ordered_waiting(share) {
                        shared.activate(&tenant).await;
                    }
                    // More may be due: its turn again, behind the others.
                    // (Not for ordered work merely queued: heads backing
                    // off would be queued by every walk; the probe finds
                    // them once due.)
                    if report.claimed > 0 {
                        shared.ready.push_share(&tenant, share);
                    }
                }
                // A panic: its events were quarantined, the channel
                // replaced; the tenant goes on.
                Ok(None) => shared.ready.push_share(&tenant, share),
                Ok(Some(Err(e))) if e.is_broker() && blocked_now(session.conn()) => {
                    // The block landed on the batch: rolled back, no
                    // attempt counted; the loop waits for the lift.
                    shared.ready.push_share(&tenant, share);
                }
                Ok(Some(Err(e))) if e.is_broker() || !session.publisher_open() => {
                    shared.ready.push_share(&tenant, share);
                    session.close_publisher().await;
                    return Err(e);
                }
                // Not the tenant's fault: its database's tenants wait
                // for the census to reach it (which queues them all).
                Ok(Some(Err(e))) if e.is_unreachable() => {
                    database.lost(&e);
                    session.release_db();
                }
                Ok(Some(Err(e))) => {
                    let pause = tenant.failed(&e);
                    session.release_db();
                    let (shared, tenant, stop) = (shared.clone(), tenant.clone(), stop.clone());
                    tokio::spawn(async move {
                        sleep_or_cancel(pause, &stop).await;
                        shared.ready.push(&tenant);
                    });
                }
                Err(e) => {
                    shared.ready.push_share(&tenant, share);
                    return Err(e);
                }
            }
        }
        session.close_publisher().await;
        Ok(())
    }
}
