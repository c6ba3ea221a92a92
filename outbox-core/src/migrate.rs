//! The migration runner of the producer's and the consumer's sets.
//!
//! Each set is a list of SQL files embedded at compile time. They run in
//! order, each in its own transaction with `search_path` set to the target
//! schema, and are recorded in `<schema>.outbox_toolkit_migrations`: a run
//! cut short resumes at the next migration. Advisory locks make concurrent
//! `migrate` calls safe: one per schema, so the schemas of one database
//! migrate in parallel, and one database-wide lock that every run takes
//! shared (releases before the per-schema locks took it exclusive, so they
//! and this one still exclude each other).
//!
//! [`census`] finds the schemas of a database that hold a set, each with
//! the version it is at, in one round trip.

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
// "outbox-m" in ASCII. Runs take it shared; releases before the per-schema
// locks took it exclusive, so they and this one still exclude each other.
const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78_2d6d;

/// The first key of the per-schema locks (two `int4` keys: a lock space
/// apart from [`MIGRATION_LOCK_KEY`]'s); the second is the schema name's
/// hash (two schemas of one hash merely take turns).
const SCHEMA_LOCK_KEY: i32 = 0x6f75_746d;

/// Applies every migration of `set` not yet applied in `schema`, creating
/// the schema if needed. Returns the versions it applied (empty: nothing
/// to do). It runs on a connection of `pool` that it closes afterwards,
/// without a statement timeout (whatever the pool's options set).
pub async fn apply(pool: &PgPool, set: &MigrationSet, schema: &Ident) -> Result<Vec<i32>> {
    apply_to(pool, set, schema, set.latest()).await
}

/// [`apply`] up to `version` (inclusive) only: a schema left behind on
/// purpose, as one an older release migrated is (tests of the tools that
/// find and upgrade such schemas).
pub async fn apply_to(
    pool: &PgPool,
    set: &MigrationSet,
    schema: &Ident,
    version: i32,
) -> Result<Vec<i32>> {
    let mut conn = pool.acquire().await?;
    // This session takes session-level locks; whatever happens (an
    // error, an aborted transaction, a cancelled future) it must not go
    // back to the pool still holding them. Closing it releases them.
    conn.close_on_drop();
    // No statement timeout a pool's options set (the relay's CLI sets
    // 30 s): an index built on a large outbox takes minutes, and a run
    // waits for another's locks as long as that one migrates. The
    // session is closed afterwards, so nothing else runs without it.
    sqlx::query("SET statement_timeout = 0")
        .execute(&mut *conn)
        .await?;
    sqlx::query("SELECT pg_advisory_lock_shared($1)")
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    sqlx::query("SELECT pg_advisory_lock($1, hashtext($2))")
        .bind(SCHEMA_LOCK_KEY)
        .bind(schema.as_str())
        .execute(&mut *conn)
        .await?;
    let applied = apply_locked(&mut conn, set, schema, version).await?;
    // Release at once; the close on drop is the safety net, not the path.
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext($2)), pg_advisory_unlock_shared($3)")
        .bind(SCHEMA_LOCK_KEY)
        .bind(schema.as_str())
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    Ok(applied)
}

async fn apply_locked(
    conn: &mut PgConnection,
    set: &MigrationSet,
    schema: &Ident,
    version: i32,
) -> Result<Vec<i32>> {
    let mut tx = conn.begin().await?;
    sqlx::raw_sql(render(include_str!("migrate/ledger.sql"), schema))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    let current = current_version(conn, set, schema).await?;
    check_not_newer(set, schema, current)?;
    let mut applied = Vec::new();
    let due = set
        .migrations
        .iter()
        .filter(|m| m.version > current && m.version <= version);
    for m in due {
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
    if !applied.is_empty() {
        // A fleet serving this database looks for its tenants at once
        // (its census runs every few seconds anyway: this is a hint).
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(SCHEMAS_CHANNEL)
            .bind(schema.as_str())
            .execute(&mut *conn)
            .await?;
    }
    Ok(applied)
}

/// The channel a migration that applied something notifies, with the
/// schema's name as the payload: a relay fleet (`outbox-relay run
/// --all-schemas`) listens on it and looks for new tenants at once. Not a
/// schema's wake-up channel (those are `outbox_<schema>`; a schema name
/// holds no dot).
pub const SCHEMAS_CHANNEL: &str = "outbox.schemas";

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

/// Where one schema stands in a migration set, as [`census`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchemaVersion {
    /// The schema's name.
    pub schema: String,
    /// How its version compares with the set's newest.
    pub state: SchemaState,
}

/// How a schema's migration version compares with a set's newest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaState {
    /// At the set's newest version.
    Current(i32),
    /// Migrated by an older release: components of this one refuse it
    /// until `migrate` runs.
    Behind {
        /// The version found.
        found: i32,
        /// The set's newest.
        needed: i32,
    },
    /// Migrated by a newer release than this one.
    TooNew {
        /// The version found.
        found: i32,
        /// The set's newest.
        known: i32,
    },
    /// Its ledger exists but this role may not read it (no `USAGE` on the
    /// schema or no `SELECT` on `outbox_toolkit_migrations`).
    Unreadable,
}

impl SchemaState {
    fn of(found: Option<i32>, set: &MigrationSet) -> Self {
        match found {
            None => Self::Unreadable,
            Some(v) if v == set.latest() => Self::Current(v),
            Some(v) if v < set.latest() => Self::Behind {
                found: v,
                needed: set.latest(),
            },
            Some(v) => Self::TooNew {
                found: v,
                known: set.latest(),
            },
        }
    }
}

impl std::fmt::Display for SchemaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Current(v) => write!(f, "current (version {v})"),
            Self::Behind { found, needed } => {
                write!(f, "behind (version {found} of {needed}): run migrate")
            }
            Self::TooNew { found, known } => write!(
                f,
                "too new (version {found}; these tools know {known}): upgrade them"
            ),
            Self::Unreadable => {
                f.write_str("unreadable (no USAGE on the schema or SELECT on its ledger)")
            }
        }
    }
}

/// Every schema of the database that holds `set` (at any version; one
/// whose ledger holds only another set's migrations is left out), its
/// name `LIKE` `pattern` when one is given, in name order: one round trip
/// per [`CENSUS_PAGE`] schemas (`migrate/census.sql`). A schema whose
/// ledger this role may not read is listed as [`SchemaState::Unreadable`],
/// not an error: one tenant's revoked grant hides no other. A schema
/// dropped while its page is read fails the call (try again).
pub async fn census(
    pool: &PgPool,
    set: &MigrationSet,
    pattern: Option<&str>,
) -> Result<Vec<SchemaVersion>> {
    let mut found = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let rows: Vec<(String, bool, Option<i32>)> =
            sqlx::query_as(include_str!("migrate/census.sql"))
                .bind(set.name)
                .bind(pattern)
                .bind(after.as_deref())
                .bind(CENSUS_PAGE)
                .fetch_all(pool)
                .await?;
        let full = rows.len() as i64 == CENSUS_PAGE;
        after = rows.last().map(|(schema, _, _)| schema.clone());
        found.extend(
            rows.into_iter()
                .filter(|(_, readable, version)| !readable || version.is_some())
                .map(|(schema, _, version)| SchemaVersion {
                    schema,
                    state: SchemaState::of(version, set),
                }),
        );
        if !full {
            return Ok(found);
        }
    }
}

/// How many schemas one statement of [`census`] reads: each ledger read
/// holds a lock until its statement ends, and the server's lock table
/// holds about 64 per connection by default.
pub const CENSUS_PAGE: i64 = 500;
