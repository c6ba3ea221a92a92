//! The write-ahead-log capture's set-up and state: what `outbox-relay
//! migrate --capture wal` creates and what `status` shows of the slot
//! ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).

use outbox::Ident;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};

use crate::error::{Error, Result};

/// What [`create_wal_slot`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalSetUp {
    /// The publication was created (it did not exist).
    pub publication_created: bool,
    /// The slot was created (it did not exist).
    pub slot_created: bool,
}

/// Creates what the write-ahead-log capture of `schema` reads, where
/// missing: an empty publication and the logical replication slot (plugin
/// `pgoutput`), both named `outbox_<schema>`. Needs `wal_level = logical`
/// and a role with `REPLICATION` (or superuser) and `CREATE` on the
/// database. Creating a slot waits for transactions running at that
/// moment to end. From then on the slot keeps every WAL segment until a
/// relay reads it: run a relay with `--capture wal`, or drop the slot
/// ([`drop_wal_slot`]).
pub async fn create_wal_slot(pool: &PgPool, schema: &Ident) -> Result<WalSetUp> {
    let slot = outbox::wal_slot_name(schema);
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await?;
    if wal_level != "logical" {
        return Err(Error::WalRefused(format!(
            "the database's wal_level is {wal_level:?}: set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )));
    }
    let row = crate::wal::slot_row(pool, &slot).await?;
    if row
        .as_ref()
        .is_some_and(|r| r.wal_status.as_deref() == Some("lost"))
    {
        return Err(Error::WalRefused(crate::wal::lost_message(&slot)));
    }
    let publication_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(&slot)
            .fetch_one(pool)
            .await?;
    if !publication_exists {
        // An empty publication: the relay reads logical decoding messages
        // only, never table changes. The name is a validated identifier.
        sqlx::query(AssertSqlSafe(format!("CREATE PUBLICATION \"{slot}\"")))
            .execute(pool)
            .await?;
    }
    let slot_created = row.is_none();
    if slot_created {
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(pool)
            .await?;
    } else if let Some(e) = crate::wal::refusal(&slot, row.as_ref()) {
        return Err(e);
    }
    Ok(WalSetUp {
        publication_created: !publication_exists,
        slot_created,
    })
}

/// Drops `schema`'s slot and publication (where they exist): turning the
/// write-ahead-log capture off. Events written to the log and not yet
/// published are lost with the slot. Fails while a relay reads the slot.
/// Returns whether a slot was dropped.
pub async fn drop_wal_slot(pool: &PgPool, schema: &Ident) -> Result<bool> {
    let slot = outbox::wal_slot_name(schema);
    let dropped: Option<bool> = sqlx::query_scalar(
        "SELECT pg_drop_replication_slot(slot_name) IS NULL FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(&slot)
    .fetch_optional(pool)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS \"{slot}\""
    )))
    .execute(pool)
    .await?;
    Ok(dropped.is_some())
}

/// The slot of the write-ahead-log capture, as `status` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct WalSlot {
    /// `outbox_<schema>`.
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
    Ok(sqlx::query_as(
        "SELECT s.slot_name::text AS slot, s.active, r.application_name AS reader,
                pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS lag_bytes,
                extract(epoch FROM r.flush_lag)::float8 AS lag_s,
                s.wal_status, s.safe_wal_size, s.confirmed_flush_lsn::text AS confirmed_flush_lsn
         FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
         WHERE s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(outbox::wal_slot_name(schema))
    .fetch_optional(pool)
    .await?)
}
