//! The demo's place on this machine: one database per service, a `demo`
//! schema in each, and fixed queue and exchange names, all reset at start
//! so that every run begins from nothing.

use anyhow::{Context, Result};
use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, options::QueueBindOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

/// Schema used in every demo database.
pub(crate) const SCHEMA: &str = "demo";
/// The relay's exchange.
pub(crate) const EXCHANGE: &str = "demo.events";
/// Binding key of every queue: all order events.
pub(crate) const BINDING_KEY: &str = "order.#";
/// The inventory consumer's queue.
pub(crate) const INVENTORY_QUEUE: &str = "demo.inventory";
/// The notifications consumer's queue.
pub(crate) const NOTIFICATIONS_QUEUE: &str = "demo.notifications";
/// A plain queue the demo reads itself to see what is on the wire.
pub(crate) const AUDIT_QUEUE: &str = "demo.audit";

/// Pools on the demo's databases, each service on its own.
#[derive(Debug, Clone)]
pub(crate) struct Databases {
    pub(crate) orders: PgPool,
    pub(crate) relay: PgPool,
    pub(crate) inventory: PgPool,
    pub(crate) notifications: PgPool,
}

/// Creates the databases if missing, drops the previous run's schemas and
/// opens the pools. `url` names any database of the server; only its
/// connection settings are used.
pub(crate) async fn databases(url: &str) -> Result<Databases> {
    let base: PgConnectOptions = url.parse().context("parsing DATABASE_URL")?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(base.clone())
        .await
        .context("connecting to PostgreSQL (run `make services`)")?;
    let open = |db: &str, app: &str, max: u32| {
        let options = base.clone().database(db).application_name(app);
        PgPoolOptions::new()
            .max_connections(max)
            .connect_lazy_with(options)
    };
    for db in ["demo_orders", "demo_inventory", "demo_notifications"] {
        create_database(&admin, db).await?;
        let pool = open(db, "demo-reset", 1);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"
        )))
        .execute(&pool)
        .await
        .with_context(|| format!("resetting schema {SCHEMA} of {db}"))?;
        pool.close().await;
    }
    admin.close().await;
    Ok(Databases {
        orders: open("demo_orders", "demo-orders", 24),
        relay: open("demo_orders", "demo-relay", 6),
        inventory: open("demo_inventory", "demo-inventory", 4),
        notifications: open("demo_notifications", "demo-notifications", 4),
    })
}

async fn create_database(admin: &PgPool, db: &str) -> Result<()> {
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(db)
            .fetch_one(admin)
            .await?;
    if exists {
        return Ok(());
    }
    match sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(admin)
        .await
    {
        Ok(_) => {
            println!("demo: created database {db}");
            Ok(())
        }
        // Created meanwhile by someone else: fine.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating database {db}")),
    }
}

/// Deletes the previous run's queues (with their retry queues and DLQs)
/// and exchange.
pub(crate) async fn reset_broker(conn: &Connection) -> Result<()> {
    let ch = conn.create_channel().await?;
    for queue in [INVENTORY_QUEUE, NOTIFICATIONS_QUEUE] {
        for name in [
            queue.to_owned(),
            format!("{queue}.retry"),
            format!("{queue}.dlq"),
        ] {
            ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await
                .with_context(|| format!("deleting queue {name}"))?;
        }
    }
    ch.queue_delete(AUDIT_QUEUE.into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(EXCHANGE.into(), ExchangeDeleteOptions::default())
        .await?;
    let _ = ch.close(200, "reset".into()).await;
    Ok(())
}

/// Declares the audit queue, bound like the consumers' queues. It is
/// exclusive to this connection: it disappears with the demo.
pub(crate) async fn declare_audit_queue(conn: &Connection) -> Result<()> {
    let ch = conn.create_channel().await?;
    let options = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    ch.queue_declare(AUDIT_QUEUE.into(), options, FieldTable::default())
        .await?;
    ch.queue_bind(
        AUDIT_QUEUE.into(),
        EXCHANGE.into(),
        BINDING_KEY.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}
