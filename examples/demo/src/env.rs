//! The demo's place on this machine: one database per service, a `demo`
//! schema in each, and fixed queue and exchange names, all reset at start
//! so that every run begins from nothing.

use std::time::Duration;

use anyhow::{Context, Result};
use lapin::options::{
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use crate::broker::{Broker, bounded};

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

/// Bound on deleting a queue: RabbitMQ waits about 5 s for each member of
/// a quorum queue on a node that is down.
const DELETE_TIMEOUT: Duration = Duration::from_secs(30);

/// Deletes the previous run's queues (with their retry queues and DLQs),
/// the audit queue and the exchange.
pub(crate) async fn reset_broker(broker: &Broker) -> Result<()> {
    broker
        .run(async |conn| {
            let ch = bounded("channel open", conn.create_channel()).await?;
            for name in all_queues() {
                let deleted = ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default());
                outbox_core::amqp::bounded("queue.delete", DELETE_TIMEOUT, deleted)
                    .await
                    .with_context(|| format!("deleting queue {name}"))?;
            }
            let deleted = ch.exchange_delete(EXCHANGE.into(), ExchangeDeleteOptions::default());
            bounded("exchange.delete", deleted).await?;
            let _ = bounded("channel close", ch.close(200, "reset".into())).await;
            Ok(())
        })
        .await
}

/// The consumers' queues with their retry queues and DLQs, and the audit
/// queue.
fn all_queues() -> Vec<String> {
    let mut queues: Vec<String> = [INVENTORY_QUEUE, NOTIFICATIONS_QUEUE]
        .iter()
        .flat_map(|q| [q.to_string(), format!("{q}.retry"), format!("{q}.dlq")])
        .collect();
    queues.push(AUDIT_QUEUE.to_owned());
    queues
}

/// The queues whose messages are deliveries still to settle: the
/// consumers' work and retry queues.
pub(crate) fn unsettled_queues() -> Vec<String> {
    [INVENTORY_QUEUE, NOTIFICATIONS_QUEUE]
        .iter()
        .flat_map(|q| [q.to_string(), format!("{q}.retry")])
        .collect()
}

/// Declares the audit queue, bound like the consumers' queues: a quorum
/// queue like theirs, so it keeps what the relay published while a node
/// is lost and the demo reconnects to another. [`reset_broker`] deletes
/// it.
pub(crate) async fn declare_audit_queue(broker: &Broker) -> Result<()> {
    broker
        .run(async |conn| {
            let ch = bounded("channel open", conn.create_channel()).await?;
            let mut args = FieldTable::default();
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            let declared =
                ch.queue_declare(AUDIT_QUEUE.into(), QueueDeclareOptions::durable(), args);
            bounded("queue.declare", declared).await?;
            let bound = ch.queue_bind(
                AUDIT_QUEUE.into(),
                EXCHANGE.into(),
                BINDING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            );
            bounded("queue.bind", bound).await?;
            let _ = bounded("channel close", ch.close(200, "declared".into())).await;
            Ok(())
        })
        .await
}
