//! One tenant of the fleet: a schema holding the outbox, with the stages a
//! `Relay` on it would have (claims, settle, quarantine, floor, leases,
//! stats: [`Worker`] and [`Maintenance`]), one claim state per fleet worker,
//! and its upkeep run only while it has work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::claim::ClaimState;
use crate::config::RelayConfig;
use crate::health::Health;
use crate::maintenance::Maintenance;
use crate::mutex::lock;
use crate::stages::Stages;
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use crate::worker::Worker;
use outbox_core::outage::Outage;

/// How long a tenant with no work keeps its upkeep (lease rounds, floor
/// readings) running.
pub(crate) const IDLE_AFTER: Duration = Duration::from_secs(60);

/// What became of a tenant's last batches.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TenantHealth {
    /// Its batches go through (or it had none).
    Ok,
    /// Its batches fail (its schema dropped, its grants revoked, …):
    /// tried again with backoff; every other tenant goes on.
    Failing {
        /// The last failure.
        error: String,
        /// How many in a row.
        failures: u32,
    },
    /// The census found the schema but the fleet does not serve it: its
    /// migrations are behind or too new for this release, or the role
    /// cannot read them. Served once mended.
    NotServed {
        /// Why, as `outbox-relay schemas` says it.
        why: String,
    },
}

/// One share of a tenant: what a relay's worker holds of it (a tenant has
/// one fewer than the fleet has workers, at least one).
#[derive(Debug)]
struct Share {
    claim: Mutex<ClaimState>,
    /// In the ready queue now.
    queued: AtomicBool,
    /// A worker runs its turn now.
    running: AtomicBool,
}

/// One tenant: its stages and its state in the fleet.
pub(crate) struct Tenant {
    /// Its schema.
    pub(crate) schema: Ident,
    /// Which of the fleet's databases it lives in.
    pub(crate) site: usize,
    pub(crate) worker: Arc<Worker>,
    maintenance: Arc<Maintenance>,
    wakeups: Wakeups,
    stats: Arc<Stats>,
    /// Its shares, one fewer than the fleet's workers (at least one): each
    /// with its claim state (its ordered partitions and cursors).
    shares: Vec<Share>,
    /// The census removed it: no more turns, no upkeep.
    retired: AtomicBool,
    /// Its upkeep, while it runs.
    upkeep: Mutex<Option<CancellationToken>>,
    /// When a batch of it last claimed something.
    last_work: Mutex<Instant>,
    health: Mutex<TenantHealth>,
    /// Until when its batches fail and wait (none queue it meanwhile but
    /// its own timer).
    backoff_until: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("schema", &self.schema)
            .field("site", &self.site)
            .finish_non_exhaustive()
    }
}

impl Tenant {
    /// The stages of the fleet `id` on `schema` of the database `site`
    /// (its `pool`), by `config` (whose schema is not read).
    pub(crate) fn new(
        config: &RelayConfig,
        schema: Ident,
        site: usize,
        id: Uuid,
        pool: PgPool,
        health: Arc<Health>,
        broker_outage: Arc<Outage>,
    ) -> Self {
        let Stages {
            wakeups,
            stats,
            maintenance,
            worker,
            ..
        } = Stages::new(config, &schema, id, pool, health, broker_outage);
        // A tenant runs on all workers but one at most (each share is one
        // worker's turn), so another tenant's event finds a worker free
        // rather than waiting for a batch of a backlog; and a wake-up
        // queues no more empty turns than that.
        let workers = config.workers.saturating_sub(1).max(1);
        Self {
            schema,
            site,
            worker,
            maintenance,
            wakeups,
            stats,
            shares: (0..workers)
                .map(|i| Share {
                    claim: Mutex::new(ClaimState::new(i, workers)),
                    queued: AtomicBool::new(false),
                    running: AtomicBool::new(false),
                })
                .collect(),
            retired: AtomicBool::new(false),
            upkeep: Mutex::new(None),
            last_work: Mutex::new(Instant::now()),
            health: Mutex::new(TenantHealth::Ok),
            backoff_until: Mutex::new(None),
        }
    }

    /// How many shares it has.
    pub(crate) fn shares(&self) -> usize {
        self.shares.len()
    }

    /// Marks share `share` queued; false when it was already.
    pub(crate) fn mark_queued(&self, share: usize) -> bool {
        !self.retired.load(Ordering::Acquire)
            && !self.shares[share].queued.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn unmark_queued(&self, share: usize) {
        self.shares[share].queued.store(false, Ordering::Release);
    }

    /// Takes share `share` for a turn: its claim state, to swap into the
    /// worker's session; `None` when another worker runs it or the tenant
    /// left the fleet. [`end_turn`](Self::end_turn) gives it back.
    pub(crate) fn begin_turn(&self, share: usize) -> Option<ClaimState> {
        let s = &self.shares[share];
        if self.retired.load(Ordering::Acquire) || s.running.swap(true, Ordering::AcqRel) {
            return None;
        }
        let placeholder = ClaimState::new(share, self.shares.len());
        Some(std::mem::replace(&mut *lock(&s.claim), placeholder))
    }

    /// Share `share`'s turn ended: its claim state back.
    pub(crate) fn end_turn(&self, share: usize, claim: ClaimState) {
        let s = &self.shares[share];
        *lock(&s.claim) = claim;
        s.running.store(false, Ordering::Release);
    }

    /// Whether share `share`'s next claim looks for ordered events (its
    /// last probe found some, or it has ordered work queued).
    pub(crate) fn ordered_waiting(&self, share: usize) -> bool {
        lock(&self.shares[share].claim).claims_ordered()
    }

    /// Starts its upkeep (lease rounds, floor readings, the archive), if it
    /// does not run; true when it started (the caller runs the first lease
    /// round, before its claim: ordered claims need the leases). A floor
    /// reading that caught up queues it with `wake`. Each upkeep holds a
    /// clone of `done`, so the fleet's shutdown waits for its leases'
    /// release.
    pub(crate) fn activate(
        self: &Arc<Self>,
        root: &CancellationToken,
        done: tokio::sync::mpsc::Sender<()>,
        wake: impl Fn() + Send + Sync + 'static,
    ) -> bool {
        *lock(&self.last_work) = Instant::now();
        let mut upkeep = lock(&self.upkeep);
        if upkeep.as_ref().is_some_and(|t| !t.is_cancelled())
            || self.retired.load(Ordering::Acquire)
        {
            return false;
        }
        let stop = root.child_token();
        *upkeep = Some(stop.clone());
        let tenant = self.clone();
        tokio::spawn(async move {
            let mut woken = tenant.wakeups.subscribe();
            let forward = async move {
                while woken.changed().await.is_ok() {
                    wake();
                }
            };
            tokio::select! {
                _ = tenant.maintenance.run(stop.clone()) => {}
                _ = forward => {}
                _ = stop.cancelled() => {}
            }
            tenant.maintenance.release_leases().await;
            drop(done);
        });
        true
    }

    /// Its upkeep runs now.
    pub(crate) fn upkeep_runs(&self) -> bool {
        lock(&self.upkeep)
            .as_ref()
            .is_some_and(|t| !t.is_cancelled())
    }

    /// The lease round (and the stats), now.
    pub(crate) async fn round(&self) {
        self.maintenance.round().await;
    }

    /// Stops its upkeep if it had no work for [`IDLE_AFTER`] (its leases
    /// are given up).
    pub(crate) fn rest_if_idle(&self) {
        if lock(&self.last_work).elapsed() < IDLE_AFTER {
            return;
        }
        self.rest();
    }

    /// Stops its upkeep now (its leases are given up): another fleet
    /// serves it.
    pub(crate) fn rest(&self) {
        if let Some(stop) = lock(&self.upkeep).take() {
            stop.cancel();
        }
    }

    /// Stops its upkeep now, and its turns (the tenant left the fleet).
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        if let Some(stop) = lock(&self.upkeep).take() {
            stop.cancel();
        }
    }

    /// A batch of it claimed `claimed` events.
    pub(crate) fn worked(&self, claimed: usize) {
        *lock(&self.health) = TenantHealth::Ok;
        *lock(&self.backoff_until) = None;
        if claimed > 0 {
            *lock(&self.last_work) = Instant::now();
        }
    }

    /// Its batches fail and it waits for its next try.
    pub(crate) fn backing_off(&self) -> bool {
        lock(&self.backoff_until).is_some_and(|until| Instant::now() < until)
    }

    /// A batch of it failed with `error`: how long to wait before its next
    /// turn (doubling from 100 ms to 30 s; nothing but its own timer
    /// queues it meanwhile).
    pub(crate) fn failed(&self, error: &crate::error::Error) -> Duration {
        let mut health = lock(&self.health);
        let failures = match &*health {
            TenantHealth::Failing { failures, .. } => failures + 1,
            _ => 1,
        };
        if failures == 1 {
            tracing::warn!(schema = %self.schema, error = %error, "tenant's batch failed; retrying it with backoff, the other tenants go on");
        }
        *health = TenantHealth::Failing {
            error: error.to_string(),
            failures,
        };
        let exp = failures.saturating_sub(1).min(9);
        let pause = (Duration::from_millis(100) * 2u32.pow(exp)).min(Duration::from_secs(30));
        *lock(&self.backoff_until) = Some(Instant::now() + pause);
        pause
    }

    /// What became of its last batches.
    pub(crate) fn health(&self) -> TenantHealth {
        lock(&self.health).clone()
    }

    /// Events it published since the fleet started.
    pub(crate) fn published(&self) -> u64 {
        self.stats.published()
    }
}
