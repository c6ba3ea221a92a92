//! What holds the xmin horizon back, and what it costs the outbox: the
//! oldest snapshot or transaction a vacuum of the outbox must respect, and
//! the dead rows it keeps (docs/OPERATIONS.md, "A held xmin horizon").
//!
//! Rows a transaction deleted stay on disk, and their index entries in the
//! indexes, until no snapshot that could see them is left. Whatever holds
//! the oldest one, a session's snapshot or open transaction, a standby's
//! feedback through a physical slot, a prepared transaction, holds every
//! published event's row: the outbox grows, and (before the claim's cursor,
//! `claim/floor.rs`) claims slowed down with it.

use outbox::Ident;
use outbox_core::sql::render;
use serde::Serialize;
use sqlx::PgPool;

use super::Result;

/// A horizon older than this is worth a line in `status` and a banner on
/// the console (the alert waits longer, see deploy/prometheus).
pub const HORIZON_NOTEWORTHY_S: f64 = 300.0;

/// The outbox's horizon: who holds it furthest back, and the dead rows.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub struct Horizon {
    /// The holder of the oldest xmin that the outbox's vacuum must
    /// respect; `None` when nothing holds one (or this role may see none
    /// of them: other roles' sessions need `pg_read_all_stats`).
    pub oldest: Option<HorizonHolder>,
    /// Dead rows in the outbox table (`pg_stat_user_tables.n_dead_tup`,
    /// an estimate): what no vacuum may remove yet, or has not yet.
    pub outbox_dead_rows: i64,
    /// The outbox table and its indexes on disk, bytes.
    pub outbox_bytes: i64,
}

/// One holder of the horizon.
#[derive(Debug, Clone, Serialize, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct HorizonHolder {
    /// `session` (a connection's snapshot or transaction), `standby` (a
    /// walsender carrying a standby's feedback), `slot` (a replication
    /// slot's `xmin`), `prepared` (a prepared transaction).
    pub kind: String,
    /// The session's process id (sessions and standbys).
    pub pid: Option<i32>,
    /// The session's `application_name` (its user when it set none), the
    /// slot's name, or the prepared transaction's gid.
    pub name: String,
    /// The session's state (`idle in transaction`, `active`, ...), or
    /// whether the slot is `active`/`inactive`.
    pub state: Option<String>,
    /// Transactions begun since its xmin (`age(xmin)`).
    pub age_xids: i64,
    /// Seconds since its transaction began (or since it was prepared);
    /// `None` for a slot, which has no start.
    pub age_s: Option<f64>,
}

impl Horizon {
    /// Held long enough to say so: `status` prints it, the console shows a
    /// banner.
    pub fn noteworthy(&self) -> bool {
        self.oldest
            .as_ref()
            .and_then(|h| h.age_s)
            .is_some_and(|s| s >= HORIZON_NOTEWORTHY_S)
            || self.oldest.as_ref().is_some_and(|h| h.kind == "slot")
                && self.outbox_dead_rows >= 100_000
    }

    /// One line: who, how long, what it keeps.
    pub fn describe(&self) -> String {
        let Some(h) = &self.oldest else {
            return format!(
                "nothing holds it ({} dead outbox rows)",
                self.outbox_dead_rows
            );
        };
        let who = match (h.kind.as_str(), h.pid) {
            ("slot", _) => format!("replication slot {:?}", h.name),
            ("prepared", _) => format!("prepared transaction {:?}", h.name),
            (kind, Some(pid)) => format!("{kind} pid {pid} ({:?})", h.name),
            (kind, None) => format!("{kind} {:?}", h.name),
        };
        let state = h
            .state
            .as_deref()
            .map_or(String::new(), |s| format!(", {s}"));
        let age = h
            .age_s
            .map_or(String::new(), |s| format!("held {} by ", human_age(s)));
        format!(
            "{age}{who}{state}: {} transactions old; {} dead outbox rows, outbox {} MiB",
            h.age_xids,
            self.outbox_dead_rows,
            self.outbox_bytes / (1024 * 1024)
        )
    }
}

fn human_age(s: f64) -> String {
    let s = s.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        _ => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

/// Reads the horizon of `schema`'s outbox. Cheap: catalog views and the
/// table's statistics, no scan.
///
/// A session counts if it is in this database (its snapshot or
/// transaction holds this database's rows) or in none (a walsender: a
/// standby's feedback holds every database's); a slot by its `xmin` (a
/// logical slot's `catalog_xmin` holds only the system catalogs); a
/// prepared transaction of this database.
pub async fn horizon(pool: &PgPool, schema: &Ident) -> Result<Horizon> {
    let oldest = sqlx::query_as(
        "SELECT kind, pid, name, state, age_xids::int8 AS age_xids, age_s FROM (
             SELECT CASE WHEN backend_type = 'walsender' THEN 'standby' ELSE 'session' END AS kind,
                    pid, coalesce(nullif(application_name, ''), usename::text, backend_type) AS name,
                    state,
                    greatest(age(backend_xmin), age(backend_xid)) AS age_xids,
                    extract(epoch FROM now() - coalesce(xact_start, query_start, backend_start))::float8 AS age_s
             FROM pg_stat_activity
             WHERE (datname = current_database() OR datname IS NULL)
               AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
               AND pid <> pg_backend_pid()
             UNION ALL
             SELECT 'slot', active_pid, slot_name::text,
                    CASE WHEN active THEN 'active' ELSE 'inactive' END,
                    age(xmin), NULL
             FROM pg_replication_slots WHERE xmin IS NOT NULL
             UNION ALL
             SELECT 'prepared', NULL, gid, NULL, age(transaction),
                    extract(epoch FROM now() - prepared)::float8
             FROM pg_prepared_xacts WHERE database = current_database()) h
         ORDER BY age_xids DESC NULLS LAST, age_s DESC NULLS LAST
         LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    // The schema is a validated identifier: no quote can be in it.
    let (outbox_dead_rows, outbox_bytes): (i64, i64) =
        sqlx::query_as(render(include_str!("horizon/outbox_cost.sql"), schema))
            .fetch_one(pool)
            .await?;
    Ok(Horizon {
        oldest,
        outbox_dead_rows,
        outbox_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(kind: &str, age_s: Option<f64>, dead: i64) -> Horizon {
        Horizon {
            oldest: Some(HorizonHolder {
                kind: kind.to_owned(),
                pid: Some(4242),
                name: "psql".to_owned(),
                state: Some("idle in transaction".to_owned()),
                age_xids: 51_234,
                age_s,
            }),
            outbox_dead_rows: dead,
            outbox_bytes: 300 << 20,
        }
    }

    #[test]
    fn a_session_holding_it_for_minutes_is_named_with_its_state_and_cost() {
        let h = held("session", Some(754.0), 3_400_000);
        assert!(h.noteworthy());
        assert_eq!(
            h.describe(),
            "held 12m 34s by session pid 4242 (\"psql\"), idle in transaction: 51234 transactions old; 3400000 dead outbox rows, outbox 300 MiB"
        );
        assert!(!held("session", Some(20.0), 10).noteworthy());
    }

    #[test]
    fn a_slot_has_no_age_and_is_noteworthy_by_what_it_keeps() {
        let h = held("slot", None, 200_000);
        assert!(h.noteworthy());
        assert!(
            h.describe().starts_with("replication slot \"psql\", idle"),
            "{}",
            h.describe()
        );
        assert!(!held("slot", None, 10).noteworthy());
    }
}
