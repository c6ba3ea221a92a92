//! Partition leases of ordered events: each relay publishes the ordered
//! aggregates of the partitions it leases (64 partitions of the aggregate
//! key space, shared fairly, handed over when a relay dies or stops). The
//! round itself is the `outbox_lease_tick` function (migration 3); it runs
//! in the maintenance round beside the workers, only while the relay has
//! a broker session (a relay that cannot publish lets its leases lapse).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox::Ident;
use sqlx::{PgPool, SqlStr};
use uuid::Uuid;

use crate::mutex::lock;
use crate::sql::render;

/// This relay's leases: the round's statements and what it last held.
#[derive(Debug)]
pub(crate) struct Leases {
    /// This relay's identity in `outbox_relays` and `outbox_leases`.
    relay: Uuid,
    name: String,
    ttl: Duration,
    tick: SqlStr,
    release: SqlStr,
    record_broker: SqlStr,
    /// When the last round ran; one round at a time.
    last_round: tokio::sync::Mutex<Option<Instant>>,
    /// Partitions held after the last round (`usize::MAX`: none yet).
    held: AtomicUsize,
    /// The same, one bit each (the workers' ordered walks compare it with
    /// what they served: claim/ordered.rs).
    mask: AtomicU64,
    /// Bumped whenever the relay may have lost a partition, even for a
    /// moment: a round that gave one up or failed, one that came more
    /// than a TTL after the last renewal, the release. The workers then
    /// forget what they knew of their aggregates (claim/ordered.rs).
    generation: AtomicU64,
    /// When the last successful round began (its renewal's time).
    renewed: Mutex<Option<Instant>>,
    /// The broker node last written to `outbox_relays`.
    recorded_node: Mutex<Option<String>>,
}

impl Leases {
    pub(crate) fn new(schema: &Ident, relay: Uuid, name: &str, ttl: Duration) -> Self {
        Self {
            relay,
            name: name.to_owned(),
            ttl,
            tick: render(include_str!("lease/tick.sql"), schema),
            release: render(include_str!("lease/release.sql"), schema),
            record_broker: render(include_str!("lease/record_broker.sql"), schema),
            last_round: tokio::sync::Mutex::new(None),
            held: AtomicUsize::new(usize::MAX),
            mask: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            renewed: Mutex::new(None),
            recorded_node: Mutex::new(None),
        }
    }

    /// The partitions held after the last round, one bit each.
    pub(crate) fn mask(&self) -> u64 {
        self.mask.load(Ordering::Acquire)
    }

    /// See the field: changes whenever the relay may have lost a
    /// partition since.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn may_have_lost(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// How often a round is due: a third of the lease TTL.
    pub(crate) fn every(&self) -> Duration {
        self.ttl / 3
    }

    /// One lease round if one is due (at most every third of the TTL, one
    /// at a time): heartbeat, renew, rebalance, and record the broker node
    /// `node` in use. True when the round ran and succeeded. A failed
    /// round is logged and tried again a round later; leases that lapse
    /// meanwhile go to other relays, which is the point of expiring them.
    pub(crate) async fn round(&self, pool: &PgPool, node: Option<String>) -> bool {
        let Ok(mut last) = self.last_round.try_lock() else {
            return false;
        };
        if last.is_some_and(|t| t.elapsed() < self.every()) {
            return false;
        }
        let began = Instant::now();
        let held: sqlx::Result<Vec<i32>> = sqlx::query_scalar(self.tick.clone())
            .bind(self.relay)
            .bind(&self.name)
            .bind(self.ttl.as_millis() as i64)
            .fetch_all(pool)
            .await;
        // Not at every batch: at the next round's time.
        *last = Some(Instant::now());
        match held {
            Ok(held) => {
                let mask = crate::claim::ordered::mask(held.iter().copied());
                // Leases may have expired between the last renewal (no
                // earlier than that round's start) and this one (no later
                // than now).
                let lapsed = lock(&self.renewed)
                    .replace(began)
                    .is_some_and(|t| t.elapsed() > self.ttl);
                let before = self.mask.swap(mask, Ordering::AcqRel);
                if lapsed || before & !mask != 0 {
                    self.may_have_lost();
                }
                self.record_broker_node(pool, node).await;
                metrics::gauge!("outbox_relay_partitions_leased").set(held.len() as f64);
                if self.held.swap(held.len(), Ordering::Relaxed) != held.len() {
                    tracing::info!(
                        partitions = held.len(),
                        "ordered-event partitions leased by this relay"
                    );
                }
                true
            }
            Err(e) => {
                self.may_have_lost();
                tracing::warn!(error = %e, "lease round failed; retrying at the next round");
                false
            }
        }
    }

    /// Writes the broker node in use to this relay's `outbox_relays` row
    /// (for `outbox-relay status`) when it changed since last written.
    async fn record_broker_node(&self, pool: &PgPool, node: Option<String>) {
        if node.is_none() || *lock(&self.recorded_node) == node {
            return;
        }
        let written = sqlx::query(self.record_broker.clone())
            .bind(self.relay)
            .bind(node.as_deref())
            .execute(pool)
            .await;
        match written {
            Ok(_) => *lock(&self.recorded_node) = node,
            Err(e) => tracing::debug!(error = %e, "could not record the broker node; next round"),
        }
    }

    /// Gives up this relay's leases at once (on shutdown), so survivors do
    /// not wait for them to expire.
    pub(crate) async fn release(&self, pool: &PgPool) {
        // Held no more (or soon, should the release fail).
        self.mask.store(0, Ordering::Release);
        self.may_have_lost();
        if let Err(e) = sqlx::query(self.release.clone())
            .bind(self.relay)
            .execute(pool)
            .await
        {
            tracing::warn!(error = %e, "could not release partition leases; they expire by themselves");
        }
    }
}
