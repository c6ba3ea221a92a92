//! The maintenance round beside the workers, every third of the lease TTL
//! while the relay has a broker session (the first is run by the first
//! worker whose channel opened, before its first claim): the lease round
//! ([`Leases`](crate::lease::Leases)), then the broker node in use and the
//! publish stats ([`Stats`](crate::stats::Stats)). A batch never runs it.

use tokio_util::sync::CancellationToken;

use crate::claim::floor;
use crate::db::bounded;
use crate::error::Error;
use crate::relay::Relay;
use crate::wake::sleep_or_cancel;

impl Relay {
    /// One round, if one is due; each of its statements bounded by the
    /// database timeout (a round cut short is tried again at the next).
    pub(crate) async fn maintenance_round(&self) {
        let inner = &self.inner;
        let node = inner.health.broker_node();
        let t = inner.config.database_timeout;
        let leases = bounded("the lease round", t * 2, async {
            Ok::<_, Error>(inner.leases.round(&inner.pool, node).await)
        });
        match leases.await {
            Ok(true) => {
                let stats = bounded("the publish stats", t, async {
                    inner.stats.write(&inner.pool).await;
                    Ok::<_, Error>(())
                });
                if let Err(e) = stats.await {
                    tracing::debug!(error = %e, "publish stats not written; next round");
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "lease round failed; retrying at the next round"),
        }
    }

    /// Reads the claim's floor every [`floor::EVERY`] until `stop`; a
    /// reading that fails or is late leaves the last floor (a long
    /// writer's rows then wait for the next reading's catch-up). A
    /// reading that caught up wakes the workers: the writer's commit
    /// woke them before, when its rows lay behind the cursors.
    pub(crate) async fn track_floor(&self, stop: CancellationToken) {
        let inner = &self.inner;
        while !stop.is_cancelled() {
            let read = bounded("the claim floor", inner.config.database_timeout, async {
                Ok::<_, Error>(inner.floor.read(&inner.pool).await?)
            });
            match read.await {
                Ok(true) => self.wake(),
                Ok(false) => {}
                Err(e) => tracing::debug!(error = %e, "claim floor not read; next reading"),
            }
            sleep_or_cancel(floor::EVERY, &stop).await;
        }
    }

    /// With `--archive`: the archive's upkeep ([`crate::archive`]) now and
    /// every [`crate::archive::EVERY`] until `stop`; a pass that fails is
    /// tried again at the next.
    pub(crate) async fn keep_archive(&self, stop: CancellationToken) {
        let inner = &self.inner;
        if !inner.config.archive {
            return;
        }
        while !stop.is_cancelled() {
            let retention = inner.config.archive_retention;
            let t = inner.config.database_timeout;
            match crate::archive::upkeep(&inner.pool, &inner.schema, retention, t).await {
                Ok(pass) if !pass.dropped.is_empty() || pass.deleted > 0 => {
                    tracing::info!(days = ?pass.dropped, deleted = pass.deleted, "archive retention");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "archive upkeep failed; next pass in an hour"),
            }
            sleep_or_cancel(crate::archive::EVERY, &stop).await;
        }
    }

    /// Rounds until `stop`.
    pub(crate) async fn maintain(&self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            sleep_or_cancel(self.inner.leases.every(), &stop).await;
            self.maintenance_round().await;
        }
    }
}
