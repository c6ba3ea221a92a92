//! One database of the fleet: its pool, its tenants (found by the census
//! every few seconds), the LISTEN session for all of them, and the probe
//! that finds the tenants with due events (the safety net under lost
//! notifications, and how retries that came due are found).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use outbox::{Ident, SchemaState};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::members::Members;
use super::tenant::Tenant;
use crate::db::bounded;
use crate::error::Result;
use outbox_core::backoff::{Backoff, sleep_or_cancel};
use outbox_core::migrate::SCHEMAS_CHANNEL;
use outbox_core::outage::Outage;

/// How many tenants one probe statement looks at.
const PROBE_CHUNK: usize = 200;

/// How long the listener may hear nothing before it checks its link.
const CHECK_WHEN_QUIET: Duration = Duration::from_secs(10);

/// One database of the fleet.
pub(crate) struct Site {
    /// Its place in the fleet's list.
    index: usize,
    pub(crate) pool: PgPool,
    /// Its tenants, by schema name: every schema the census found current.
    tenants: RwLock<BTreeMap<String, Arc<Tenant>>>,
    /// The schemas the census found but the fleet does not serve (behind,
    /// too new, unreadable), and why.
    refused: RwLock<Vec<(String, SchemaState)>>,
    /// Bumped when the tenants change (the listener's channels follow).
    changed: watch::Sender<u64>,
    /// Whether its census answers (logged once per outage).
    outage: Outage,
    /// A migration notified: the census runs now, not at its interval.
    census_now: tokio::sync::Notify,
    /// Tenants may have work nobody was told of (they joined, the
    /// listener was away, the database is back): the probe runs now. One
    /// probe statement per 200 tenants finds them; queueing every tenant
    /// would make as many turns, nearly all empty, ahead of everyone's
    /// events (a fleet starting over 1,000 tenants took seconds to serve
    /// anything else).
    probe_now: tokio::sync::Notify,
    /// A batch found the database unreachable: its tenants get no turns
    /// (each would wait out the database timeout, holding a worker every
    /// other database's tenants need) until the census reaches it again.
    unreachable: std::sync::atomic::AtomicBool,
    /// The fleets sharing its tenants, and which are this one's.
    members: Members,
}

impl std::fmt::Debug for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Site")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Site {
    pub(crate) fn new(index: usize, pool: PgPool, fleet: uuid::Uuid) -> Self {
        Self {
            index,
            pool,
            tenants: RwLock::new(BTreeMap::new()),
            refused: RwLock::new(Vec::new()),
            changed: watch::channel(0).0,
            outage: Outage::new("database", format!("outbox-relay fleet, database {index}")),
            census_now: tokio::sync::Notify::new(),
            probe_now: tokio::sync::Notify::new(),
            unreachable: std::sync::atomic::AtomicBool::new(false),
            members: Members::new(fleet),
        }
    }

    /// Whether this fleet serves `tenant` (another fleet over the same
    /// database may: [`Members`]).
    pub(crate) fn owns(&self, tenant: &Tenant) -> bool {
        self.members.owns(tenant.schema.as_str())
    }

    /// Whether its tenants wait for the database to answer again.
    pub(crate) fn unreachable(&self) -> bool {
        self.unreachable.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A batch found the database unreachable (`error`): its tenants wait
    /// until the census answers, tried at once and then every second.
    pub(crate) fn lost(&self, error: &crate::error::Error) {
        if !self
            .unreachable
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            tracing::warn!(database = self.index, error = %error, "database unreachable: its tenants wait until it answers again; the other databases' go on");
        }
        self.census_now.notify_one();
    }

    /// Its tenants now.
    pub(crate) fn tenants(&self) -> Vec<Arc<Tenant>> {
        self.tenants
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// The schemas the last census found and the fleet does not serve.
    pub(crate) fn refused(&self) -> Vec<(String, SchemaState)> {
        self.refused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn tenant(&self, schema: &str) -> Option<Arc<Tenant>> {
        self.tenants
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(schema)
            .cloned()
    }

    /// Everything beside the workers until `stop`: the census, the probe,
    /// the listener, and each tenant's rest once idle.
    pub(crate) async fn run(&self, shared: &Arc<Shared>, stop: CancellationToken) {
        tokio::join!(
            self.keep_members(shared, stop.clone()),
            self.keep_census(shared, stop.clone()),
            self.keep_probing(shared, stop.clone()),
            self.listen(shared, stop),
        );
    }

    /// The membership round every third of the lease TTL until `stop`,
    /// then leaving. When the live fleets change, the tenants this fleet
    /// now serves are queued and those it gave up rest (their partition
    /// leases released for the fleet that takes them).
    async fn keep_members(&self, shared: &Shared, stop: CancellationToken) {
        let cfg = &shared.config;
        let every = (cfg.lease_ttl / 3).max(Duration::from_millis(100));
        while !stop.is_cancelled() {
            match self
                .members
                .round(&self.pool, &cfg.name, cfg.lease_ttl, cfg.database_timeout)
                .await
            {
                Ok(true) => {
                    tracing::info!(
                        database = self.index,
                        fleets = self.members.fleets(),
                        "the fleets sharing this database's tenants changed"
                    );
                    for t in self.tenants() {
                        if !self.owns(&t) {
                            t.rest();
                        }
                    }
                    self.probe_now.notify_one();
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(database = self.index, error = %e, "the fleets' heartbeat failed; the last view holds")
                }
            }
            sleep_or_cancel(every, &stop).await;
        }
        self.members.leave(&self.pool, cfg.database_timeout).await;
    }

    /// The census now and every `discover_every`, and at once when a
    /// migration notifies ([`outbox_core::migrate::SCHEMAS_CHANNEL`]):
    /// tenants added (the probe runs at once: they may hold a backlog) and removed.
    async fn keep_census(&self, shared: &Shared, stop: CancellationToken) {
        use std::sync::atomic::Ordering;
        while !stop.is_cancelled() {
            match self.census(shared).await {
                Ok(()) => {
                    self.outage.ok();
                    shared.database_up(self.index, true);
                    if self.unreachable.swap(false, Ordering::AcqRel) {
                        tracing::info!(
                            database = self.index,
                            "database answers again: its tenants are served"
                        );
                        self.probe_now.notify_one();
                    }
                }
                Err(e) => {
                    // The known tenants go on while their batches do;
                    // unreachable, they wait for the census.
                    if e.is_unreachable() {
                        self.unreachable.store(true, Ordering::Release);
                    }
                    self.outage.failed(&e);
                    shared.database_up(self.index, false);
                }
            }
            for t in self.tenants() {
                t.rest_if_idle();
            }
            let next = if self.unreachable() {
                shared.discover_every.min(Duration::from_secs(1))
            } else {
                shared.discover_every
            };
            tokio::select! {
                _ = sleep_or_cancel(next, &stop) => {}
                _ = self.census_now.notified() => {}
            }
        }
    }

    async fn census(&self, shared: &Shared) -> Result<()> {
        let t = shared.config.database_timeout;
        let found = bounded("the census", t, async {
            outbox::census(&self.pool, shared.like.as_deref()).await
        })
        .await?;
        let mut current = BTreeMap::new();
        let mut refused = Vec::new();
        for s in found {
            match s.state {
                SchemaState::Current(_) => {
                    current.insert(s.schema, ());
                }
                state => refused.push((s.schema, state)),
            }
        }
        let (added, removed) = {
            let mut tenants = self.tenants.write().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<String> = tenants
                .keys()
                .filter(|k| !current.contains_key(*k))
                .cloned()
                .collect();
            let removed: Vec<Arc<Tenant>> = gone.iter().filter_map(|k| tenants.remove(k)).collect();
            let mut added = Vec::new();
            for name in current.into_keys() {
                if tenants.contains_key(&name) {
                    continue;
                }
                let Ok(schema) = Ident::new("schema", &name) else {
                    continue;
                };
                let tenant = Arc::new(Tenant::new(
                    &shared.config,
                    schema,
                    self.index,
                    shared.id,
                    self.pool.clone(),
                    shared.health.clone(),
                    shared.broker_outage.clone(),
                ));
                tenants.insert(name, tenant.clone());
                added.push(tenant);
            }
            (added, removed)
        };
        for t in &removed {
            tracing::info!(schema = %t.schema, "tenant left the fleet (its schema is gone or no longer current)");
            t.retire();
        }
        for t in &added {
            tracing::info!(schema = %t.schema, "tenant joined the fleet");
        }
        if !added.is_empty() {
            // It may hold a backlog.
            self.probe_now.notify_one();
        }
        for (schema, state) in &refused {
            let known = self
                .refused
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|(s, st)| s == schema && st == state);
            if !known {
                tracing::warn!(schema, state = %state, "schema holds the outbox but is not served");
            }
        }
        *self.refused.write().unwrap_or_else(|p| p.into_inner()) = refused;
        if !added.is_empty() || !removed.is_empty() {
            self.changed.send_modify(|g| *g = g.wrapping_add(1));
        }
        Ok(())
    }

    /// The probe every poll interval: each tenant with a due event queued,
    /// and its upkeep started when ordered events are due (without its
    /// partition leases no claim takes them, and a claim that takes
    /// nothing would not start it). A chunk whose statement fails (a
    /// tenant's schema dropped since the census) queues each of its
    /// tenants: their own batches tell.
    async fn keep_probing(&self, shared: &Arc<Shared>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            tokio::select! {
                _ = sleep_or_cancel(shared.config.poll_interval, &stop) => {}
                _ = self.probe_now.notified() => {}
            }
            if self.unreachable() {
                continue;
            }
            // Tenants backing off are left out: one whose statements fail
            // (a grant revoked) would fail its chunk's probe.
            let mut tenants = self.tenants();
            tenants.retain(|t| !t.backing_off() && self.owns(t));
            for chunk in tenants.chunks(PROBE_CHUNK) {
                match self.probe(chunk, shared.config.database_timeout).await {
                    Ok(due) => {
                        for (i, ordered) in due {
                            let tenant = &chunk[i];
                            if ordered && !tenant.upkeep_runs() {
                                let (shared, tenant) = (shared.clone(), tenant.clone());
                                tokio::spawn(async move {
                                    shared.activate(&tenant).await;
                                    shared.queue(&tenant);
                                });
                            } else {
                                shared.queue(tenant);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "probe failed; queueing its tenants");
                        chunk.iter().for_each(|t| shared.queue(t));
                    }
                }
            }
        }
    }

    /// The tenants of `chunk` with due events (their places in it), and
    /// whether ordered ones are among them.
    async fn probe(&self, chunk: &[Arc<Tenant>], timeout: Duration) -> Result<Vec<(usize, bool)>> {
        let branches: Vec<String> = chunk
            .iter()
            .enumerate()
            .map(|(i, t)| {
                outbox_core::sql::Template::new(include_str!("probe.sql"), &t.schema)
                    .with("i", i.to_string())
                    .text()
            })
            .collect();
        let sql = outbox_core::sql::Template::unqualified("{branches}")
            .with("branches", branches.join("\nUNION ALL\n"))
            .render();
        let due: Vec<(i32, bool)> = bounded("the probe", timeout, async {
            sqlx::query_as(sql).fetch_all(&self.pool).await
        })
        .await?;
        Ok(due
            .into_iter()
            .filter_map(|(i, ordered)| Some((usize::try_from(i).ok()?, ordered)))
            .filter(|(i, _)| *i < chunk.len())
            .collect())
    }

    /// One LISTEN session for every tenant's wake-up channel, until
    /// `stop`: a notification queues its tenant; a reconnect runs the
    /// probe (notifications sent meanwhile are gone).
    async fn listen(&self, shared: &Shared, stop: CancellationToken) {
        if !shared.config.listen {
            return;
        }
        let timeout = shared.config.database_timeout;
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let mut changed = self.changed.subscribe();
        while !stop.is_cancelled() {
            let own = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(timeout)
                .connect_lazy_with((*self.pool.connect_options()).clone());
            changed.borrow_and_update();
            let channels: Vec<String> = self
                .tenants()
                .iter()
                .map(|t| outbox::wakeup_channel(&t.schema))
                .chain([SCHEMAS_CHANNEL.to_owned()])
                .collect();
            let listener = async {
                let mut l = PgListener::connect_with(&own).await?;
                l.listen_all(channels.iter().map(String::as_str)).await?;
                Ok::<_, sqlx::Error>(l)
            };
            let mut listening: std::collections::HashSet<String> =
                channels.iter().cloned().collect();
            let mut listener = match tokio::time::timeout(timeout, listener).await {
                Ok(Ok(l)) => l,
                _ => {
                    if backoff.failures() == 0 {
                        tracing::warn!(
                            database = self.index,
                            "fleet's wake-up listener cannot connect; the probe alone finds work until it can"
                        );
                    }
                    sleep_or_cancel(backoff.next_delay(), &stop).await;
                    continue;
                }
            };
            backoff.reset();
            // Notifications sent while it was away are gone: the probe
            // and the census run now.
            self.probe_now.notify_one();
            self.census_now.notify_one();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    // Tenants joined: their channels too (the census
                    // queued them). A tenant gone keeps its channel until
                    // the next reconnect: its notifications find no one.
                    _ = changed.changed() => {
                        let now: Vec<String> = self
                            .tenants()
                            .iter()
                            .map(|t| outbox::wakeup_channel(&t.schema))
                            .filter(|c| !listening.contains(c))
                            .collect();
                        let more = listener.listen_all(now.iter().map(String::as_str));
                        if !matches!(tokio::time::timeout(timeout, more).await, Ok(Ok(()))) {
                            break;
                        }
                        listening.extend(now);
                    }
                    r = listener.try_recv() => match r {
                        Ok(Some(n)) if n.channel() == SCHEMAS_CHANNEL => self.census_now.notify_one(),
                        Ok(Some(n)) => {
                            let schema = n.channel().strip_prefix("outbox_").unwrap_or_default();
                            if let Some(t) = self.tenant(schema) {
                                shared.queue(&t);
                            }
                        }
                        Ok(None) => {
                            self.probe_now.notify_one();
                            self.census_now.notify_one();
                        }
                        Err(_) => break,
                    },
                    _ = tokio::time::sleep(CHECK_WHEN_QUIET) => {
                        let check = sqlx::query("SELECT 1").execute(&mut listener);
                        if !matches!(tokio::time::timeout(timeout, check).await, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
        }
    }
}
