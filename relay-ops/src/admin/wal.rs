//! The write-ahead-log capture's state as `status` shows it: its slot.

use outbox::Ident;
use serde::Serialize;
use sqlx::PgPool;

use super::Result;
use outbox_relay::recorded_wal_slot;

/// The slot of the write-ahead-log capture, as `status` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct WalSlot {
    /// Its name (as recorded for the schema in `outbox_wal_capture`).
    pub slot: String,
    /// A relay reads it now.
    pub active: bool,
    /// The reading session's `application_name` (`outbox-relay <name>`).
    pub reader: Option<String>,
    /// Bytes of WAL written since the position the reader confirmed: what
    /// the slot keeps on disk, and an upper bound of what is left to read.
    pub lag_bytes: Option<i64>,
    /// How long ago the last position the reader reported was written,
    /// as the server measures it (`pg_stat_replication.flush_lag`; none
    /// when the reader is idle and caught up, or not connected).
    pub lag_s: Option<f64>,
    /// `reserved`, `extended`, `unreserved` (WAL about to be removed) or
    /// `lost` (invalidated: the relay can no longer read it).
    pub wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is at risk
    /// of invalidation (`max_slot_wal_keep_size`); none when unlimited.
    pub safe_wal_size: Option<i64>,
    /// The position the reader confirmed.
    pub confirmed_flush_lsn: Option<String>,
}

/// `schema`'s slot, or `None` when the capture is not set up.
pub async fn wal_slot(pool: &PgPool, schema: &Ident) -> Result<Option<WalSlot>> {
    let Some(slot) = recorded_wal_slot(pool, schema).await? else {
        return Ok(None);
    };
    Ok(sqlx::query_as(
        "SELECT s.slot_name::text AS slot, s.active, r.application_name AS reader,
                pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS lag_bytes,
                extract(epoch FROM r.flush_lag)::float8 AS lag_s,
                s.wal_status, s.safe_wal_size, s.confirmed_flush_lsn::text AS confirmed_flush_lsn
         FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
         WHERE s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?)
}
