//! The migration runner of the producer's and the consumer's sets.
//!
//! Each set is a list of SQL files embedded at compile time. They run in
//! order, each in its own transaction with `search_path` set to the target
//! schema, and are recorded in `<schema>.outbox_toolkit_migrations`. A
//! database-wide advisory lock makes concurrent `migrate` calls safe.

// Identifiers in SQL text are validated `Ident`s; values are always bound.
use sqlx::{Connection, PgConnection, PgPool};

use crate::sql::render;

use crate::ident::Ident;

/// Why a migration run or check failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// The database has not been migrated (or is behind this library).
    #[error(
        "{what} in schema {schema:?} is not migrated (found version {found}, need {needed}); run `{fix}`"
    )]
    NotMigrated {
        /// Which schema set is missing (`"the outbox"`, `"the inbox"`).
        what: &'static str,
        /// The schema that was checked.
        schema: String,
        /// The migration version found (0 when none).
        found: i32,
        /// The version this library needs.
        needed: i32,
        /// The command that fixes it.
        fix: &'static str,
    },
    /// The database is at a newer migration version than this library knows.
    #[error(
        "schema {schema:?} is at migration version {found} of the {set} set, newer than this library's {known}; upgrade the library"
    )]
    SchemaTooNew {
        /// The schema that was checked.
        schema: String,
        /// The migration set.
        set: &'static str,
        /// The version found.
        found: i32,
        /// The newest version this library knows.
        known: i32,
    },
    /// The database returned an error.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

type Result<T, E = MigrateError> = std::result::Result<T, E>;

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version, starting at 1, strictly increasing within a set.
    pub version: i32,
    /// Short name, recorded with the version.
    pub name: &'static str,
    /// The SQL, run as one transaction.
    pub sql: &'static str,
}

/// A named, ordered set of migrations.
#[derive(Debug, Clone, Copy)]
pub struct MigrationSet {
    /// The set's name (`producer`, `consumer`).
    pub name: &'static str,
    /// Human description used in errors (`"the outbox"`).
    pub what: &'static str,
    /// The command that applies this set, named in `NotMigrated` errors.
    pub fix: &'static str,
    /// The migrations in order.
    pub migrations: &'static [Migration],
}

impl MigrationSet {
    /// The newest version in this set.
    pub fn latest(&self) -> i32 {
        self.migrations.last().map_or(0, |m| m.version)
    }
}

// Any key works as long as it is the same in every process; this one spells
// "outbox-m" in ASCII.
const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78_2d6d;

/// Applies every migration of `set` not yet applied in `schema`, creating
/// the schema if needed. Returns the versions it applied (empty: nothing
/// to do).
pub async fn apply(pool: &PgPool, set: &MigrationSet, schema: &Ident) -> Result<Vec<i32>> {
    let mut conn = pool.acquire().await?;
    // This session takes a session-level lock; whatever happens (an
    // error, an aborted transaction, a cancelled future) it must not go
    // back to the pool still holding it. Closing it releases the lock.
    conn.close_on_drop();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    let applied = apply_locked(&mut conn, set, schema).await?;
    // Release at once; the close on drop is the safety net, not the path.
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    Ok(applied)
}

async fn apply_locked(
    conn: &mut PgConnection,
    set: &MigrationSet,
    schema: &Ident,
) -> Result<Vec<i32>> {
    let mut tx = conn.begin().await?;
    sqlx::raw_sql(render(include_str!("migrate/ledger.sql"), schema))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    let current = current_version(conn, set, schema).await?;
    check_not_newer(set, schema, current)?;
    let mut applied = Vec::new();
    for m in set.migrations.iter().filter(|m| m.version > current) {
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT set_config('search_path', $1, true)")
            .bind(schema.as_str())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(m.sql).execute(&mut *tx).await?;
        sqlx::query(render(
            "INSERT INTO {schema}.outbox_toolkit_migrations (migration_set, version, name) VALUES ($1, $2, $3)",
            schema,
        ))
        .bind(set.name)
        .bind(m.version)
        .bind(m.name)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        tracing::info!(set = set.name, schema = %schema, version = m.version, name = m.name, "applied migration");
        applied.push(m.version);
    }
    Ok(applied)
}

async fn current_version(
    conn: &mut PgConnection,
    set: &MigrationSet,
    schema: &Ident,
) -> Result<i32> {
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{}.outbox_toolkit_migrations", schema.quoted()))
        .fetch_one(&mut *conn)
        .await?;
    if exists.is_none() {
        return Ok(0);
    }
    let v: Option<i32> = sqlx::query_scalar(render(
        "SELECT max(version) FROM {schema}.outbox_toolkit_migrations WHERE migration_set = $1",
        schema,
    ))
    .bind(set.name)
    .fetch_one(&mut *conn)
    .await?;
    Ok(v.unwrap_or(0))
}

fn check_not_newer(set: &MigrationSet, schema: &Ident, found: i32) -> Result<()> {
    if found > set.latest() {
        return Err(MigrateError::SchemaTooNew {
            schema: schema.to_string(),
            set: set.name,
            found,
            known: set.latest(),
        });
    }
    Ok(())
}

/// Fails with [`MigrateError::NotMigrated`] unless `schema` holds the whole of
/// `set`. Components call this once at start-up.
pub async fn ensure_migrated(pool: &PgPool, set: &MigrationSet, schema: &Ident) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let found = current_version(&mut conn, set, schema).await?;
    check_not_newer(set, schema, found)?;
    if found < set.latest() {
        return Err(MigrateError::NotMigrated {
            what: set.what,
            schema: schema.to_string(),
            found,
            needed: set.latest(),
            fix: set.fix,
        });
    }
    Ok(())
}
