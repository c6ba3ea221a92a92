//! The replication slot: whether it can be read, what its errors mean,
//! and moving it past what a session confirmed.

use pgwire_replication::{Lsn, PgWireError};
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::wal::decode::lsn_text;

/// A slot as `pg_replication_slots` shows it.
#[derive(sqlx::FromRow)]
pub(crate) struct SlotRow {
    pub(crate) plugin: Option<String>,
    pub(crate) active: bool,
    /// `application_name` of the session holding it.
    pub(crate) holder: Option<String>,
    pub(crate) wal_status: Option<String>,
    pub(crate) confirmed_flush_lsn: Option<String>,
}

/// `schema`'s slot in this database, if it exists.
pub(crate) async fn slot_row(pool: &PgPool, slot: &str) -> Result<Option<SlotRow>> {
    Ok(sqlx::query_as(
        "SELECT s.plugin::text AS plugin, s.active, a.application_name AS holder, s.wal_status,
                s.confirmed_flush_lsn::text AS confirmed_flush_lsn
         FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
         WHERE s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?)
}

/// The backend holding `slot` now (its walsender), if any.
pub(super) async fn holder_pid(
    pool: &PgPool,
    slot: &str,
    timeout: std::time::Duration,
) -> Result<Option<i32>> {
    crate::db::on_pool(pool, "the slot's holder", timeout, async |c| {
        sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(&mut *c)
            .await
            .map(Option::flatten)
    })
    .await
}

/// What the relay says when its slot was invalidated.
pub(crate) fn lost_message(slot: &str) -> String {
    format!(
        "replication slot {slot:?} was invalidated (wal_status = lost): the relay was away longer than max_slot_wal_keep_size allows and PostgreSQL removed WAL it still needed, so events written meanwhile may be gone from it. Recreate the slot (docs/WAL_CAPTURE.md, \"a lost slot\"), then check the consumers against the producers' records for that period"
    )
}

/// Why the slot cannot be read, if it cannot.
pub(crate) fn refusal(slot: &str, row: Option<&SlotRow>) -> Option<Error> {
    let Some(row) = row else {
        return Some(Error::WalRefused(format!(
            "replication slot {slot:?} does not exist in this database; create it with `outbox-relay migrate --capture wal`"
        )));
    };
    if row.wal_status.as_deref() == Some("lost") {
        return Some(Error::WalRefused(lost_message(slot)));
    }
    if row.plugin.as_deref() != Some("pgoutput") {
        return Some(Error::WalRefused(format!(
            "replication slot {slot:?} uses the plugin {:?}, not pgoutput; drop it and run `outbox-relay migrate --capture wal`",
            row.plugin.as_deref().unwrap_or("?")
        )));
    }
    None
}

pub(super) fn wal_error(slot: &str, e: PgWireError) -> Error {
    let text = e.to_string();
    match &e {
        PgWireError::Auth(_) => {
            Error::WalRefused(format!("the replication login was refused: {text}"))
        }
        PgWireError::Server(m)
            if m.contains("can no longer get changes") || m.contains("been invalidated") =>
        {
            Error::WalRefused(lost_message(slot))
        }
        PgWireError::Server(m)
            if m.contains("does not exist")
                || m.contains("permission denied")
                || m.contains("must be superuser")
                || m.contains("must have the") =>
        {
            Error::WalRefused(text)
        }
        _ => Error::Replication(text),
    }
}

pub(super) fn slot_busy(e: &PgWireError) -> bool {
    matches!(e, PgWireError::Server(m) if m.contains("is active for PID"))
}

/// How often [`advance`] looks again while the session's own walsender
/// still holds the slot (it releases it a moment after our CopyDone).
const RELEASE_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Moves the slot to `acked` after a session ended: the stream's last
/// report may be up to a status interval old (the replication client sends
/// no status with its CopyDone), so the next session would publish that
/// again. The server releases the slot a moment after the session ends:
/// while `ours` (the session's walsender) still holds it, this waits for
/// it, up to `timeout`. A standby that took the slot meanwhile refuses the
/// move (it then publishes that interval again: duplicates only).
pub(super) async fn advance(
    pool: &PgPool,
    slot: &str,
    acked: Lsn,
    ours: Option<i32>,
    timeout: std::time::Duration,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // The slot's holder, or 0 once it was free and moved; no row: the
        // slot is gone.
        let step = sqlx::query_scalar::<_, Option<i32>>(
            "SELECT CASE WHEN s.active THEN s.active_pid
                         ELSE (SELECT 0 FROM pg_replication_slot_advance(s.slot_name, $2::text::pg_lsn)) END
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind(slot)
        .bind(lsn_text(acked.as_u64()))
        .fetch_optional(pool);
        let holder = match tokio::time::timeout_at(deadline, step).await {
            Ok(Ok(Some(Some(pid)))) if pid != 0 => pid,
            Ok(Ok(_)) => return,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "could not advance the slot after the session");
                return;
            }
            Err(_) => {
                tracing::debug!("the slot was not free to advance within the timeout");
                return;
            }
        };
        // Another session's: a standby took over. Ours (or not known):
        // the server has not released it yet.
        if ours.is_some_and(|ours| ours != holder) {
            tracing::debug!(holder, "a standby took the slot before it was advanced");
            return;
        }
        if tokio::time::Instant::now() + RELEASE_POLL >= deadline {
            tracing::debug!(holder, "the slot was not released within the timeout");
            return;
        }
        tokio::time::sleep(RELEASE_POLL).await;
    }
}
