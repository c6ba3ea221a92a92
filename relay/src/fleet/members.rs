//! How several fleets split one database's tenants: each fleet beats in
//! `outbox_fleet.outbox_fleet_members` every third of the lease TTL, its
//! heartbeat good for one TTL, and reads which fleets are alive; each
//! tenant is served by the live fleet its schema name and the fleet's id
//! weigh highest for (rendezvous hashing: a fleet that joins takes about
//! its share from each of the others, one that leaves hands its tenants
//! out among them, no other tenant moves). A fleet that joins takes its
//! share at the others' next round; one that stops leaves at once; one
//! that dies loses its share when its heartbeat lapses, within a TTL and
//! a round. While two views differ a tenant may be served by two fleets
//! for a round (safe: claims skip locked rows, ordered events need the
//! tenant's partition leases) or by none (it waits for the round).
//!
//! Without the table (`outbox-relay migrate --fleet` not run) or a grant
//! on it, each fleet serves every tenant, as one fleet does.

use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::Ident;
use outbox_core::migrate::{Migration, MigrationSet};
use sqlx::{PgPool, SqlStr};
use uuid::Uuid;

use crate::db::bounded;
use crate::error::{Error, Result};
use crate::sql::render;

/// The schema that holds the fleets' membership in each database.
pub const FLEET_SCHEMA: &str = "outbox_fleet";

/// The fleets' migration set: the membership table.
pub(crate) const FLEET: MigrationSet = MigrationSet {
    name: "fleet",
    what: "the fleets' membership",
    fix: "outbox-relay migrate --fleet",
    migrations: &[Migration {
        version: 1,
        name: "fleet_members",
        sql: include_str!("../../migrations/fleet/0001_members.sql"),
    }],
};

/// Creates (or upgrades) the fleets' membership table in schema
/// [`FLEET_SCHEMA`] of `pool`'s database; returns the migrations applied.
/// Fleets (`outbox-relay run --all-schemas`) over a database that has it
/// split its tenants between them; without it each serves every tenant.
pub async fn migrate_fleet(pool: &PgPool) -> Result<Vec<i32>> {
    let schema = Ident::new("schema", FLEET_SCHEMA)?;
    outbox_core::migrate::apply(pool, &FLEET, &schema)
        .await
        .map_err(|e| Error::Outbox(e.into()))
}

/// One fleet's membership in one database.
pub(crate) struct Members {
    id: Uuid,
    round: SqlStr,
    leave: SqlStr,
    /// The live fleets' ids, sorted; `None`: not split (no membership
    /// table, or no grant on it): this fleet serves every tenant.
    live: RwLock<Option<Vec<Uuid>>>,
    /// Said once: why the tenants are not split.
    told: AtomicBool,
}

impl Members {
    pub(crate) fn new(id: Uuid) -> Self {
        let schema = Ident::new("schema", FLEET_SCHEMA).expect("a valid schema name");
        Self {
            id,
            round: render(include_str!("members/round.sql"), &schema),
            leave: render(include_str!("members/leave.sql"), &schema),
            live: RwLock::new(None),
            told: AtomicBool::new(false),
        }
    }

    /// Whether this fleet serves the tenant in `schema`.
    pub(crate) fn owns(&self, schema: &str) -> bool {
        match &*self.live.read().unwrap_or_else(|p| p.into_inner()) {
            None => true,
            Some(live) => owner(schema, live) == Some(self.id),
        }
    }

    /// How many fleets share the database now (1 when not split).
    pub(crate) fn fleets(&self) -> usize {
        self.live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(1, Vec::len)
    }

    /// One round: the heartbeat, and the live fleets read. True when
    /// which fleets live changed. A failure keeps the last view.
    pub(crate) async fn round(
        &self,
        pool: &PgPool,
        name: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<bool> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let read = bounded("the fleets' heartbeat", timeout, async {
            sqlx::query_scalar::<_, Uuid>(self.round.clone())
                .bind(self.id)
                .bind(name)
                .bind(ttl_ms)
                .fetch_all(pool)
                .await
        })
        .await;
        let now = match read {
            Ok(mut ids) => {
                ids.sort();
                Some(ids)
            }
            Err(Error::Database(sqlx::Error::Database(e)))
                if matches!(e.code().as_deref(), Some("42P01" | "3F000" | "42501")) =>
            {
                if !self.told.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        error = %e,
                        "the fleets' membership table ({FLEET_SCHEMA}.outbox_fleet_members) cannot be used: this fleet serves every tenant; `outbox-relay migrate --fleet` (and a grant on it) lets fleets split them"
                    );
                }
                None
            }
            Err(e) => return Err(e),
        };
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        let changed = *live != now;
        *live = now;
        Ok(changed)
    }

    /// This fleet leaves (it stops): the others take its tenants at their
    /// next round.
    pub(crate) async fn leave(&self, pool: &PgPool, timeout: Duration) {
        if self
            .live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            return;
        }
        let _ = bounded("leaving the fleets", timeout, async {
            sqlx::query(self.leave.clone())
                .bind(self.id)
                .execute(pool)
                .await
        })
        .await;
    }
}

/// The live fleet that serves `schema`: the highest weight.
fn owner(schema: &str, live: &[Uuid]) -> Option<Uuid> {
    live.iter().copied().max_by_key(|m| weight(schema, m))
}

/// A stable weight of (tenant, fleet): FNV-1a over both, then mixed
/// (splitmix64's finaliser). The same in every process and release.
fn weight(schema: &str, member: &Uuid) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in schema
        .bytes()
        .chain([0xff])
        .chain(member.as_bytes().iter().copied())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleets(n: u128) -> Vec<Uuid> {
        (1..=n)
            .map(|i| Uuid::from_u128(i * 0x9e37_79b9_7f4a_7c15))
            .collect()
    }

    #[test]
    fn tenants_split_about_evenly_and_a_fleet_joining_moves_only_its_share() {
        let tenants: Vec<String> = (0..3_000).map(|i| format!("tenant_{i:04}")).collect();
        let three = fleets(3);
        let mut counts = [0usize; 3];
        for t in &tenants {
            let o = owner(t, &three).unwrap();
            counts[three.iter().position(|m| *m == o).unwrap()] += 1;
        }
        for c in counts {
            assert!((800..=1_200).contains(&c), "uneven split: {counts:?}");
        }
        // A fourth joins: every tenant that moves, moves to it.
        let four = fleets(4);
        let mut moved = 0;
        for t in &tenants {
            let (before, after) = (owner(t, &three).unwrap(), owner(t, &four).unwrap());
            if before != after {
                assert_eq!(after, four[3], "{t} moved between old fleets");
                moved += 1;
            }
        }
        assert!((550..=950).contains(&moved), "{moved} of 3000 moved");
    }

    #[test]
    fn the_weight_is_stable() {
        // Fleets of different releases must agree on who serves what.
        assert_eq!(
            weight("tenant_0001", &Uuid::from_u128(1)),
            weight("tenant_0001", &Uuid::from_u128(1))
        );
        // Pinned: a change here moves tenants between fleets of two
        // releases running side by side.
        assert_eq!(weight("a", &Uuid::nil()), 0x5560_1249_d42e_45ea);
    }
}
