//! Test helpers for services that produce events (feature `testing`): a
//! fresh schema per test, and the events a transaction enqueued.
//!
//! ```no_run
//! use outbox::testing::{TestSchema, enqueued};
//! use outbox::{NewEvent, Outbox, OutboxConfig};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // A schema of this test's own; its pool puts it first on `search_path`.
//! let db = TestSchema::create("postgres://postgres@127.0.0.1:5432/test").await?;
//! outbox::migrate(db.pool(), db.name()).await?;
//! let mut config = OutboxConfig::default();
//! config.schema = db.name().to_owned();
//! let outbox = Outbox::new(db.pool(), config).await?;
//!
//! let mut tx = db.pool().begin().await?;
//! outbox
//!     .enqueue(&mut *tx, NewEvent::new("payment", "p-1", "captured", &serde_json::json!({"cents": 500}))?)
//!     .await?;
//! // What this transaction wrote, before it commits.
//! let events = enqueued(&mut *tx, db.name()).await?;
//! assert_eq!(events.len(), 1);
//! assert_eq!(events[0].event_type, "captured");
//! assert_eq!(events[0].payload["cents"], 500);
//! tx.rollback().await?;
//! assert!(enqueued(db.pool(), db.name()).await?.is_empty()); // rolled back with it
//! db.cleanup().await?; // or let it drop: the schema goes either way
//! # Ok(()) }
//! ```

use std::time::Duration;

use outbox_core::sql::render;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use crate::error::Result;
use outbox_core::Ident;

/// A schema of one test's own, created empty in the test database, with a
/// pool whose sessions put it first on `search_path` (then `public`): the
/// service's own unqualified SQL (`INSERT INTO payments ...`) lands in it,
/// and tests running in parallel never see each other's rows. Migrate it
/// as the service does ([`crate::migrate`], `outbox_consumer::migrate`;
/// both sets live in one schema) and give the service its
/// [`name`](Self::name) as the schema.
///
/// [`cleanup`](Self::cleanup) drops it; so does dropping it, a test that
/// panics included (from a thread of its own: the drop never needs the
/// test's runtime). Its name starts with `t_`.
#[derive(Debug)]
pub struct TestSchema {
    name: Ident,
    pool: PgPool,
    options: PgConnectOptions,
    dropped: bool,
}

impl TestSchema {
    /// Creates a fresh schema in the database at `database_url` (a test
    /// database: `postgres://postgres@127.0.0.1:5432/test`).
    pub async fn create(database_url: &str) -> Result<Self> {
        let name = format!("t_{}", &Uuid::new_v4().simple().to_string()[..16]);
        Self::create_as(database_url, Ident::new("schema", &name)?).await
    }

    /// [`create`](Self::create), the name telling which test made it:
    /// `t_<prefix>_<random>`, so a schema a failed run left behind says
    /// where it came from. `prefix`: a-z, 0-9 and `_`, at most 40
    /// characters.
    pub async fn with_prefix(database_url: &str, prefix: &str) -> Result<Self> {
        let name = format!("t_{prefix}_{}", &Uuid::new_v4().simple().to_string()[..12]);
        Self::create_as(database_url, Ident::new("schema", &name)?).await
    }

    async fn create_as(database_url: &str, name: Ident) -> Result<Self> {
        let options: PgConnectOptions = database_url.parse()?;
        // The sessions are named after the schema, so the drop can end the
        // ones still open (a transaction a panicking test left behind
        // would hold its locks).
        let options = options.application_name(&application_name(&name));
        let mut conn = PgConnection::connect_with(&options).await?;
        sqlx::raw_sql(render("CREATE SCHEMA {schema}", &name))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        let search_path = format!("{name},public");
        let pool = PgPoolOptions::new().max_connections(8).connect_lazy_with(
            options
                .clone()
                .options([("search_path", search_path.as_str())]),
        );
        Ok(Self {
            name,
            pool,
            options,
            dropped: false,
        })
    }

    /// The schema's name: give it to the service as its schema.
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// A pool on the test database whose sessions have `search_path` set
    /// to this schema, then `public`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes the pool (waiting a few seconds for connections still in
    /// use, then ending their sessions) and drops the schema with
    /// everything in it.
    pub async fn cleanup(mut self) -> Result<()> {
        self.dropped = true;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.pool.close()).await;
        drop_schema(&self.options, &self.name).await
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (options, name) = (self.options.clone(), self.name.clone());
        // No runtime to await on here (and the test's may be the one
        // panicking): a thread with a runtime of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(sqlx::Error::Io)?;
            rt.block_on(drop_schema(&options, &name))
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("TestSchema: schema {} not dropped: {e}", self.name),
            Err(_) => eprintln!(
                "TestSchema: schema {} not dropped: the drop panicked",
                self.name
            ),
        }
    }
}

fn application_name(schema: &Ident) -> String {
    format!("outbox-testing {schema}")
}

/// Ends the schema's other sessions, then drops it, on a connection of
/// its own; every lock wait bounded.
async fn drop_schema(options: &PgConnectOptions, name: &Ident) -> Result<()> {
    let mut conn = PgConnection::connect_with(options).await?;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(application_name(name))
    .execute(&mut conn)
    .await?;
    sqlx::raw_sql(render(
        "SET lock_timeout = '10s'; SET client_min_messages = warning;
         DROP SCHEMA IF EXISTS {schema} CASCADE",
        name,
    ))
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    Ok(())
}

/// One event in the outbox table, as written ([`enqueued`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Enqueued {
    /// The event id (the published `message_id`).
    pub id: Uuid,
    /// What the event is about (`payment`).
    pub aggregate_type: String,
    /// Which one (`p-42`).
    pub aggregate_id: String,
    /// What happened (`captured`).
    pub event_type: String,
    /// The payload.
    pub payload: Value,
    /// The event's own headers (AMQP headers once published).
    pub headers: Map<String, Value>,
    /// The exchange, when the event names one.
    pub exchange: Option<String>,
    /// The routing key, when the event names one (the relay's default is
    /// `<aggregate_type>.<event_type>`).
    pub routing_key: Option<String>,
    /// Ordered aggregate types only: the event's number in its aggregate.
    pub aggregate_seq: Option<i64>,
}

impl Enqueued {
    /// The payload decoded into `T`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        T::deserialize(&self.payload)
    }
}

type Row = (
    Uuid,
    String,
    String,
    String,
    Value,
    Value,
    Option<String>,
    Option<String>,
    Option<i64>,
);

/// The events in `schema`'s outbox table that `conn` can see: pass the
/// transaction that enqueued them (`&mut *tx`) to read them before it
/// commits, or a pool for the committed ones. Oldest transaction first,
/// then in the order written. Nothing takes them out: with no relay
/// running, a test reads every event its code committed.
///
/// Events of [`Capture::Wal`](crate::Capture::Wal) are messages in the
/// write-ahead log, not rows: test with the default, [`Capture::Table`](crate::Capture::Table).
pub async fn enqueued<'c>(conn: impl PgExecutor<'c>, schema: &str) -> Result<Vec<Enqueued>> {
    let schema = Ident::new("schema", schema)?;
    let rows: Vec<Row> = sqlx::query_as(render(
        "SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange,
                routing_key, aggregate_seq
         FROM {schema}.outbox ORDER BY created_at, ctid",
        &schema,
    ))
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Enqueued {
            id: r.0,
            aggregate_type: r.1,
            aggregate_id: r.2,
            event_type: r.3,
            payload: r.4,
            headers: match r.5 {
                Value::Object(map) => map,
                _ => Map::new(), // the table's CHECK allows objects only
            },
            exchange: r.6,
            routing_key: r.7,
            aggregate_seq: r.8,
        })
        .collect())
}

/// Applies the producer's migrations to `schema` up to `version` only
/// (inclusive): a schema an older release migrated, for tests of what
/// finds and upgrades such schemas ([`crate::census`], `outbox-relay
/// migrate --all-schemas`).
pub async fn migrate_to(pool: &PgPool, schema: &str, version: i32) -> Result<Vec<i32>> {
    let schema = Ident::new("schema", schema)?;
    Ok(outbox_core::migrate::apply_to(pool, &crate::migrate::PRODUCER, &schema, version).await?)
}
