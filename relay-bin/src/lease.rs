//! Partition leases of ordered events: each relay publishes the ordered
//! aggregates of the partitions it leases (64 partitions of the aggregate
//! key space, shared fairly, handed over when a relay dies or stops). The
//! round itself is the `outbox_lease_tick` function (migration 3).

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::relay::{Relay, lock};

impl Relay {
    /// One lease round, at most every third of the lease TTL (whichever
    /// worker comes first): heartbeat, renew, rebalance. A failed round is
    /// logged and tried again a round later; leases that lapse meanwhile go
    /// to other relays, which is the point of expiring them.
    pub(crate) async fn lease_round(&self) {
        let inner = &self.inner;
        let cfg = &inner.config;
        let Ok(mut last) = inner.last_lease_tick.try_lock() else {
            return;
        };
        if last.is_some_and(|t| t.elapsed() < cfg.lease_ttl / 3) {
            return;
        }
        let held: sqlx::Result<Vec<i32>> = sqlx::query_scalar(inner.queries.lease_tick.clone())
            .bind(inner.id)
            .bind(&cfg.name)
            .bind(cfg.lease_ttl.as_millis() as i64)
            .fetch_all(&inner.pool)
            .await;
        match held {
            Ok(held) => {
                *last = Some(Instant::now());
                self.record_broker_node().await;
                self.record_publish_stats().await;
                metrics::gauge!("outbox_relay_partitions_leased").set(held.len() as f64);
                if inner.partitions.swap(held.len(), Ordering::Relaxed) != held.len() {
                    tracing::info!(
                        partitions = held.len(),
                        "ordered-event partitions leased by this relay"
                    );
                }
            }
            Err(e) => {
                // Not at every batch: at the next round's time.
                *last = Some(Instant::now());
                tracing::warn!(error = %e, "lease round failed; retrying at the next round");
            }
        }
    }

    /// Writes the broker node in use to this relay's `outbox_relays` row
    /// (for `outbox-relay status`) when it changed since last written.
    async fn record_broker_node(&self) {
        let inner = &self.inner;
        let node = lock(&inner.health.node).clone();
        if node.is_none() || *lock(&inner.recorded_node) == node {
            return;
        }
        let written = sqlx::query(inner.queries.record_broker.clone())
            .bind(inner.id)
            .bind(node.as_deref())
            .execute(&inner.pool)
            .await;
        match written {
            Ok(_) => *lock(&inner.recorded_node) = node,
            Err(e) => tracing::debug!(error = %e, "could not record the broker node; next round"),
        }
    }

    /// Adds what this relay settled since the last round to the minute's
    /// row of `outbox_publish_stats` (the console's publish-rate chart). A
    /// failed write is carried over to the next round.
    async fn record_publish_stats(&self) {
        let inner = &self.inner;
        let now = (
            inner.published.load(Ordering::Relaxed),
            inner.dead_lettered.load(Ordering::Relaxed),
        );
        let last = *lock(&inner.stats_written);
        let (published, dead) = (now.0 - last.0, now.1 - last.1);
        if published == 0 && dead == 0 {
            return;
        }
        let written = sqlx::query(inner.queries.publish_stats.clone())
            .bind(published as i64)
            .bind(dead as i64)
            .execute(&inner.pool)
            .await;
        match written {
            Ok(_) => *lock(&inner.stats_written) = now,
            Err(e) => tracing::debug!(error = %e, "could not record publish stats; next round"),
        }
    }

    /// Gives up this relay's leases at once (on shutdown), so survivors do
    /// not wait for them to expire.
    pub(crate) async fn release_leases(&self) {
        let inner = &self.inner;
        if let Err(e) = sqlx::query(inner.queries.lease_release.clone())
            .bind(inner.id)
            .execute(&inner.pool)
            .await
        {
            tracing::warn!(error = %e, "could not release partition leases; they expire by themselves");
        }
    }
}
