//! The write-ahead-log capture's set-up: what `outbox-relay migrate
//! --capture wal` creates (slot, publication, the schema's record of the
//! slot) and what turning the capture off drops
//! ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).

use outbox::Ident;
use outbox_core::sql::{Template, render};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// What [`create_wal_slot`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalSetUp {
    /// The slot's (and the publication's) name, now recorded for the
    /// schema.
    pub slot: String,
    /// The publication was created (it did not exist).
    pub publication_created: bool,
    /// The slot was created (it did not exist).
    pub slot_created: bool,
}

/// The replication slot the write-ahead-log capture of `schema` reads, as
/// [`create_wal_slot`] recorded it (table `outbox_wal_capture`); `None`
/// when the capture is not set up, or the schema has no such table (not a
/// producer schema, or one migrated before version 11). Producers check
/// this slot with every write, and relays read it.
pub async fn recorded_wal_slot(pool: &PgPool, schema: &Ident) -> sqlx::Result<Option<String>> {
    let recorded = sqlx::query_scalar(render(
        "SELECT slot FROM {schema}.outbox_wal_capture",
        schema,
    ))
    .fetch_optional(pool)
    .await;
    match recorded {
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P01" | "3F000")) => {
            Ok(None)
        }
        other => other,
    }
}

/// A replication slot name PostgreSQL takes as it is: `[a-z_][a-z0-9_]*`,
/// at most 63 bytes.
fn check_slot_name(slot: &str) -> Result<()> {
    let mut chars = slot.chars();
    let ok = slot.len() <= 63
        && matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(crate::error::ConfigError::SlotName(
            slot.to_owned(),
        )))
    }
}

/// Creates what the write-ahead-log capture of `schema` reads, where
/// missing: an empty publication and the logical replication slot (plugin
/// `pgoutput`) of one name, and records that name for the schema (table
/// `outbox_wal_capture`), where producers and relays find it.
///
/// `slot`: the name; `None` keeps the one recorded, or takes
/// `outbox_<schema>` ([`outbox::wal_slot_name`]) the first time. Slot
/// names are cluster-wide: two databases with a schema of the same name
/// need two names, and a name that another database's slot holds is
/// refused ([`Error::WalRefused`]). A schema whose capture reads one slot
/// is not moved to another here (drop it first: [`drop_wal_slot`]).
///
/// Needs `wal_level = logical` and a role with `REPLICATION` (or
/// superuser) and `CREATE` on the database. Creating a slot waits for
/// transactions running at that moment to end. From then on the slot keeps
/// every WAL segment until a relay reads it: run a relay with `--capture
/// wal`, or drop the slot ([`drop_wal_slot`]).
pub async fn create_wal_slot(
    pool: &PgPool,
    schema: &Ident,
    slot: Option<&str>,
) -> Result<WalSetUp> {
    check_wal_level(pool).await?;
    let recorded = recorded_wal_slot(pool, schema).await?;
    let slot = choose_slot(schema, slot, recorded)?;
    check_slot_name(&slot)?;
    check_not_elsewhere(pool, schema, &slot).await?;
    let row = crate::wal::slot_row(pool, &slot).await?;
    if row
        .as_ref()
        .is_some_and(|r| r.wal_status.as_deref() == Some("lost"))
    {
        return Err(Error::WalRefused(crate::wal::lost_message(&slot)));
    }
    let publication_created = create_publication(pool, &slot).await?;
    let slot_created = row.is_none();
    if slot_created {
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(pool)
            .await?;
    } else if let Some(e) = crate::wal::refusal(&slot, row.as_ref()) {
        return Err(e);
    }
    record_slot(pool, schema, &slot).await?;
    Ok(WalSetUp {
        slot,
        publication_created,
        slot_created,
    })
}

/// Logical decoding needs `wal_level = logical` (a restart to change).
async fn check_wal_level(pool: &PgPool) -> Result<()> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await?;
    if wal_level != "logical" {
        return Err(Error::WalRefused(format!(
            "the database's wal_level is {wal_level:?}: set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )));
    }
    Ok(())
}

/// The slot's name: the one asked for, else the one recorded, else the
/// default; never a second slot for a schema whose capture reads one.
fn choose_slot(schema: &Ident, wanted: Option<&str>, recorded: Option<String>) -> Result<String> {
    match (wanted, recorded) {
        (Some(wanted), Some(recorded)) if wanted != recorded => Err(Error::WalRefused(format!(
            "schema {schema} reads replication slot {recorded:?} already; to read {wanted:?} instead, drop that slot first (events it holds and no relay read yet are lost with it)"
        ))),
        (Some(wanted), _) => Ok(wanted.to_owned()),
        (None, Some(recorded)) => Ok(recorded),
        (None, None) => Ok(outbox::wal_slot_name(schema)),
    }
}

/// Slot names are cluster-wide: refuses one that another database's slot
/// (or a physical slot) holds.
async fn check_not_elsewhere(pool: &PgPool, schema: &Ident, slot: &str) -> Result<()> {
    let elsewhere: Option<Option<String>> = sqlx::query_scalar(
        "SELECT d.datname::text FROM pg_replication_slots s LEFT JOIN pg_database d ON d.oid = s.datoid
         WHERE s.slot_name = $1 AND s.database IS DISTINCT FROM current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?;
    if let Some(database) = elsewhere {
        let holder = database.map_or("a physical replication slot".to_owned(), |d| {
            format!("a slot of database {d:?}")
        });
        return Err(Error::WalRefused(format!(
            "replication slot {slot:?} is taken by {holder}: slot names are cluster-wide, so choose another for this database with --slot (say outbox_<database>_{schema})"
        )));
    }
    Ok(())
}

/// Creates the publication named `slot` where missing; whether it did.
/// The name must have passed `check_slot_name`.
async fn create_publication(pool: &PgPool, slot: &str) -> Result<bool> {
    let publication_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(slot)
            .fetch_one(pool)
            .await?;
    if !publication_exists {
        // An empty publication: the relay reads logical decoding messages
        // only, never table changes. The name is checked by the caller.
        sqlx::query(publication("CREATE PUBLICATION {publication}", slot))
            .execute(pool)
            .await?;
    }
    Ok(!publication_exists)
}

/// Records `slot` as the one `schema`'s capture reads.
async fn record_slot(pool: &PgPool, schema: &Ident, slot: &str) -> Result<()> {
    sqlx::query(render(include_str!("record_slot.sql"), schema))
        .bind(slot)
        .execute(pool)
        .await?;
    Ok(())
}

/// Drops `schema`'s slot and publication (where they exist) and forgets
/// the slot: turning the write-ahead-log capture off. Producers writing to
/// the log are refused from then on; events written to it and not yet
/// published are lost with the slot. Fails while a relay reads the slot.
/// Returns whether a slot was dropped.
pub async fn drop_wal_slot(pool: &PgPool, schema: &Ident) -> Result<bool> {
    let recorded = recorded_wal_slot(pool, schema).await?;
    let slot = recorded
        .clone()
        .unwrap_or_else(|| outbox::wal_slot_name(schema));
    let dropped: Option<bool> = sqlx::query_scalar(
        "SELECT pg_drop_replication_slot(slot_name) IS NULL FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(&slot)
    .fetch_optional(pool)
    .await?;
    sqlx::query(publication(
        "DROP PUBLICATION IF EXISTS {publication}",
        &slot,
    ))
    .execute(pool)
    .await?;
    if recorded.is_some() {
        sqlx::query(render("DELETE FROM {schema}.outbox_wal_capture", schema))
            .execute(pool)
            .await?;
    }
    Ok(dropped.is_some())
}

/// `template` with `{publication}` the publication of `slot` (its name: a
/// name [`check_slot_name`] passed, or one recorded after it did).
fn publication(template: &str, slot: &str) -> sqlx::SqlStr {
    Template::unqualified(template)
        .with("publication", format!("\"{slot}\""))
        .render()
}
