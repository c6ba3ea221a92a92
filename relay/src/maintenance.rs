//! The maintenance round beside the workers, every third of the lease TTL
//! while the relay has a broker session (the first is run by the first
//! worker whose channel opened, before its first claim): the lease round
//! ([`Leases`]), then the broker node in use and the publish stats
//! ([`Stats`]). A batch never runs it. Beside it, the claims' floor is
//! read from the lock table and, with `--archive`, the archive's days are
//! kept.

use std::sync::Arc;
use std::time::Duration;

use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::archive::Archive;
use crate::claim::floor::{self, Floor};
use crate::config::RelayConfig;
use crate::db::bounded;
use crate::error::Error;
use crate::health::Health;
use crate::lease::Leases;
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use outbox_core::backoff::sleep_or_cancel;

/// The relay's upkeep: leases, stats, the claims' floor, the archive.
#[derive(Debug)]
pub(crate) struct Maintenance {
    pool: PgPool,
    database_timeout: Duration,
    /// With `--archive`: its statements, and how long published events
    /// are kept.
    archive: Option<(Archive, Duration)>,
    /// Where the broker node in use is read from.
    health: Arc<Health>,
    leases: Arc<Leases>,
    stats: Arc<Stats>,
    floor: Arc<Floor>,
    /// The workers' wake-up, for the floor's catch-ups.
    wakeups: Wakeups,
}

impl Maintenance {
    /// The upkeep of `schema` by `config`; `leases`, `stats` and `floor`
    /// are the workers' too.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: &RelayConfig,
        schema: &Ident,
        pool: PgPool,
        health: Arc<Health>,
        leases: Arc<Leases>,
        stats: Arc<Stats>,
        floor: Arc<Floor>,
        wakeups: Wakeups,
    ) -> Self {
        Self {
            pool,
            database_timeout: config.database_timeout,
            archive: config
                .archive
                .then(|| (Archive::new(schema), config.archive_retention)),
            health,
            leases,
            stats,
            floor,
            wakeups,
        }
    }

    /// Everything beside the workers until `stop`: the rounds, the floor's
    /// readings and the archive's upkeep.
    pub(crate) async fn run(&self, stop: CancellationToken) {
        tokio::join!(
            self.maintain(stop.clone()),
            self.track_floor(stop.clone()),
            self.keep_archive(stop)
        );
    }

    /// One round, if one is due; each of its statements bounded by the
    /// database timeout (a round cut short is tried again at the next).
    pub(crate) async fn round(&self) {
        let node = self.health.broker_node();
        let t = self.database_timeout;
        let leases = bounded("the lease round", t * 2, async {
            Ok::<_, Error>(self.leases.round(&self.pool, node).await)
        });
        match leases.await {
            Ok(true) => {
                let stats = bounded("the publish stats", t, async {
                    self.stats.write(&self.pool).await;
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

    /// Gives this relay's partition leases up (bounded: they expire by
    /// themselves when the database does not answer).
    pub(crate) async fn release_leases(&self) {
        let release = async {
            self.leases.release(&self.pool).await;
            Ok::<_, Error>(())
        };
        if let Err(e) = bounded("the leases' release", self.database_timeout, release).await {
            tracing::warn!(error = %e, "could not release partition leases; they expire by themselves");
        }
    }

    /// Reads the claim's floor every [`floor::EVERY`] until `stop`; a
    /// reading that fails or is late leaves the last floor (a long
    /// writer's rows then wait for the next reading's catch-up). A
    /// reading that caught up wakes the workers: the writer's commit
    /// woke them before, when its rows lay behind the cursors.
    async fn track_floor(&self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let read = bounded("the claim floor", self.database_timeout, async {
                Ok::<_, Error>(self.floor.read(&self.pool).await?)
            });
            match read.await {
                Ok(true) => self.wakeups.wake(),
                Ok(false) => {}
                Err(e) => tracing::debug!(error = %e, "claim floor not read; next reading"),
            }
            sleep_or_cancel(floor::EVERY, &stop).await;
        }
    }

    /// With `--archive`: the archive's upkeep ([`crate::archive`]) now and
    /// every [`crate::archive::EVERY`] until `stop`; a pass that fails is
    /// tried again at the next.
    async fn keep_archive(&self, stop: CancellationToken) {
        let Some((archive, retention)) = &self.archive else {
            return;
        };
        while !stop.is_cancelled() {
            let t = self.database_timeout;
            match archive.upkeep(&self.pool, *retention, t).await {
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
    async fn maintain(&self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            sleep_or_cancel(self.leases.every(), &stop).await;
            self.round().await;
        }
    }
}
