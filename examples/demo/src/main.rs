//! `make demo`: orders written with their events in one transaction, the
//! relay publishing them through a crash, and a report that checks the
//! guarantees.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use outbox::{NewEvent, Outbox, OutboxConfig};
use outbox_relay::{Relay, RelayConfig};
use serde_json::json;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

/// The outbox toolkit's demo.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Orders to place.
    #[arg(long, default_value_t = 3000)]
    orders: usize,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let pool = sqlx::PgPool::connect(&args.database_url)
        .await
        .context("connecting to PostgreSQL")?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let schema = format!("demo_{run}");
    outbox::migrate(&pool, &schema).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".orders (id text PRIMARY KEY, sku text NOT NULL, qty int NOT NULL)"
    )))
    .execute(&pool)
    .await?;
    println!("demo: schema {schema} migrated");

    // The queue a consumer reads, bound to the relay's exchange.
    let exchange = format!("demo.{run}");
    let conn = Connection::connect(&args.amqp_url, ConnectionProperties::default())
        .await
        .context("connecting to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await?;
    let q = QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    ch.queue_declare(exchange.as_str().into(), q, FieldTable::default())
        .await?;
    ch.queue_bind(
        exchange.as_str().into(),
        exchange.as_str().into(),
        "order.*".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let mut consumer = ch
        .basic_consume(
            exchange.as_str().into(),
            "demo".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let consume = tokio::spawn({
        let seen = seen.clone();
        async move {
            while let Some(Ok(d)) = consumer.next().await {
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                let _ = d.acker.ack(BasicAckOptions::default()).await;
                *seen.lock().unwrap().entry(id).or_default() += 1;
            }
        }
    });

    let relay_config = RelayConfig {
        amqp_url: args.amqp_url.clone(),
        schema: schema.clone(),
        default_exchange: exchange.clone(),
        declare_exchange: None,
        batch_size: 100,
        ..RelayConfig::default()
    };
    let relay = Relay::new(pool.clone(), relay_config.clone()).await?;
    let stop = CancellationToken::new();
    let first = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });

    // Place orders: one transaction each writes the order and its event.
    // Every tenth transaction rolls back after enqueueing.
    let outbox = Outbox::new(&pool, OutboxConfig::default().schema(&schema)).await?;
    let (mut committed, mut rolled_back) = (HashSet::new(), HashSet::new());
    let mut crashed = false;
    for i in 0..args.orders {
        let order = format!("o-{i}");
        let mut tx = pool.begin().await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".orders (id, sku, qty) VALUES ($1, $2, $3)"
        )))
        .bind(&order)
        .bind("A-1")
        .bind(1 + (i % 3) as i32)
        .execute(&mut *tx)
        .await?;
        let event = NewEvent::new(
            "order",
            &order,
            "OrderPlaced",
            &json!({"order": order, "sku": "A-1"}),
        )?;
        let id = outbox.enqueue(&mut *tx, event).await?.to_string();
        if i % 10 == 9 {
            tx.rollback().await?;
            rolled_back.insert(id);
        } else {
            outbox.commit(tx).await?;
            committed.insert(id);
        }
        if i == args.orders / 2 && !crashed {
            // Crash the relay mid-stream: its tasks die with batches in
            // flight; their rows stay in the outbox for the next relay.
            first.abort();
            crashed = true;
            println!("demo: relay killed after {i} orders; starting a new one");
        }
        if i % 500 == 499 {
            println!(
                "demo: {} orders placed, {} events seen by the consumer",
                i + 1,
                seen.lock().unwrap().len()
            );
        }
    }
    let second_stop = CancellationToken::new();
    let relay2 = Relay::new(pool.clone(), relay_config).await?;
    let second = tokio::spawn({
        let stop = second_stop.clone();
        async move { relay2.run(stop).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while committed
        .iter()
        .any(|id| !seen.lock().unwrap().contains_key(id))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    second_stop.cancel();
    stop.cancel();
    second.await??;
    consume.abort();
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".outbox"
    )))
    .fetch_one(&pool)
    .await?;

    let seen = seen.lock().unwrap().clone();
    let published = committed.iter().filter(|id| seen.contains_key(*id)).count();
    let leaked = rolled_back
        .iter()
        .filter(|id| seen.contains_key(*id))
        .count();
    let duplicates: usize = seen.values().map(|c| c - 1).sum();
    println!(
        "\n==== report ({:.1}s) ====",
        started.elapsed().as_secs_f64()
    );
    println!("orders committed               {}", committed.len());
    println!("orders rolled back             {}", rolled_back.len());
    println!("events published (distinct)    {published}");
    println!("duplicate deliveries on wire   {duplicates}");
    println!("rolled-back events published   {leaked}");
    println!("events left in the outbox      {left}");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await?;
    let _ = ch
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
    ensure!(
        published == committed.len(),
        "CHECK FAILED: {} committed events were never published",
        committed.len() - published
    );
    ensure!(
        leaked == 0,
        "CHECK FAILED: {leaked} events of rolled-back transactions were published"
    );
    ensure!(left == 0, "CHECK FAILED: {left} events left in the outbox");
    println!(
        "checks: every committed event published, no rolled-back event published, outbox empty: OK"
    );
    Ok(())
}
