//! `make bench`: measures the toolkit against raw ceilings taken in the same
//! run, prints a table and writes JSON. `--smoke` runs tiny counts (CI).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use outbox::{NewEvent, Outbox, OutboxConfig, Wakeup};
use outbox_relay::{Relay, RelayConfig};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;

/// Benchmarks the outbox toolkit against the local services.
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
    /// Tiny counts, to prove the benchmark still runs.
    #[arg(long)]
    smoke: bool,
    /// Where to write the results.
    #[arg(long, default_value = "target/bench/results.json")]
    out: std::path::PathBuf,
}

struct Sizes {
    drain_events: usize,
    write_secs: f64,
    latency_secs: f64,
}

const PAYLOAD_BYTES: usize = 500;

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let sizes = if args.smoke {
        Sizes {
            drain_events: 2_000,
            write_secs: 0.5,
            latency_secs: 1.0,
        }
    } else {
        Sizes {
            drain_events: 100_000,
            write_secs: 5.0,
            latency_secs: 10.0,
        }
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.database_url)
        .await
        .context("connecting to the database")?;
    let mut results = serde_json::Map::new();
    let mut table = Vec::new();

    // Raw ceiling and relay drain, same message size, same kind of queue.
    let raw = raw_publish_rate(&args.amqp_url, sizes.drain_events).await?;
    let drain = relay_drain_rate(&pool, &args.amqp_url, sizes.drain_events).await?;
    results.insert("raw_publish_per_s".into(), json!(raw));
    results.insert("relay_drain_per_s".into(), json!(drain));
    results.insert("relay_drain_ratio".into(), json!(drain / raw));
    table.push((
        "raw confirmed publishes/s (plain lapin)",
        format!("{raw:.0}"),
    ));
    table.push(("relay drain events/s", format!("{drain:.0}")));
    table.push(("relay_drain_ratio", format!("{:.2}", drain / raw)));

    // Write path: 8 writers, with and without one event, per wake-up mode.
    let base = write_path(&pool, None, sizes.write_secs).await?;
    results.insert("write_tx_per_s_baseline".into(), json!(base));
    table.push((
        "write path tx/s, no event (8 writers)",
        format!("{base:.0}"),
    ));
    for (name, mode) in [
        ("after_commit", Wakeup::AfterCommit),
        ("in_transaction", Wakeup::InTransaction),
        ("poll_only", Wakeup::PollOnly),
    ] {
        let rate = write_path(&pool, Some(mode), sizes.write_secs).await?;
        results.insert(format!("write_tx_per_s_{name}"), json!(rate));
        results.insert(format!("write_path_ratio_{name}"), json!(rate / base));
        table.push((
            leak(format!("write path tx/s + event, wake-up {name}")),
            format!("{rate:.0} ({:.2}x)", rate / base),
        ));
    }
    let ratio = results["write_path_ratio_after_commit"].clone();
    results.insert("write_path_ratio".into(), ratio);

    // Commit-to-publish latency at a steady 1,000 events/s.
    let lat = publish_latency(&pool, &args.amqp_url, sizes.latency_secs).await?;
    for (k, v) in &lat {
        results.insert(k.clone(), json!(v));
        table.push((leak(k.clone()), format!("{v:.2}")));
    }

    println!("\n{:<48} value", "metric");
    for (k, v) in &table {
        println!("{k:<48} {v}");
    }
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&Value::Object(results))?,
    )?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// A durable topic exchange and durable queue bound with `#`.
async fn topology(conn: &Connection, name: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await?;
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(name.into(), q, FieldTable::default())
        .await?;
    ch.queue_bind(
        name.into(),
        name.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

async fn drop_queue(conn: &Connection, name: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    ch.queue_delete(name.into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(name.into(), Default::default()).await?;
    Ok(())
}

fn payload() -> Value {
    json!({ "pad": "x".repeat(PAYLOAD_BYTES - 10) })
}

/// Persistent, mandatory, confirmed publishes with plain lapin, in windows
/// of 500 confirms in flight (the relay's batch size).
async fn raw_publish_rate(url: &str, n: usize) -> Result<f64> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let name = format!("bench.raw.{}", suffix());
    topology(&conn, &name).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = serde_json::to_vec(&payload())?;
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let started = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for _ in chunk {
            let props = BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_delivery_mode(2)
                .with_content_type("application/json".into());
            confirms.push(
                ch.basic_publish(name.as_str().into(), "raw.bench".into(), opts, &body, props)
                    .await?,
            );
        }
        for c in confirms {
            anyhow::ensure!(
                matches!(c.await?, lapin::Confirmation::Ack(None)),
                "raw publish not acked"
            );
        }
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop_queue(&conn, &name).await?;
    Ok(rate)
}

async fn fresh_schema(pool: &PgPool, prefix: &str) -> Result<String> {
    let schema = format!("bench_{prefix}_{}", suffix());
    outbox::migrate(pool, &schema).await?;
    Ok(schema)
}

async fn drop_schema(pool: &PgPool, schema: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(pool)
        .await?;
    Ok(())
}

/// One relay (default settings) draining a backlog of `n` events.
async fn relay_drain_rate(pool: &PgPool, url: &str, n: usize) -> Result<f64> {
    let schema = fresh_schema(pool, "drain").await?;
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let name = format!("bench.drain.{}", suffix());
    topology(&conn, &name).await?;
    let ob = Outbox::new(
        pool,
        OutboxConfig::default()
            .schema(&schema)
            .wakeup(Wakeup::PollOnly),
    )
    .await?;
    for start in (0..n).step_by(1000) {
        let events = (start..(start + 1000).min(n))
            .map(|i| NewEvent::new("order", format!("o-{i}"), "OrderPlaced", &payload()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tx = pool.begin().await?;
        ob.enqueue_many(&mut *tx, events).await?;
        tx.commit().await?;
    }
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE \"{schema}\".outbox")))
        .execute(pool)
        .await?;
    let config = RelayConfig {
        amqp_url: url.to_owned(),
        schema: schema.clone(),
        default_exchange: name.clone(),
        declare_exchange: None,
        ..RelayConfig::default()
    };
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let relay = Relay::new(relay_pool, config).await?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    let count_sql = format!("SELECT count(*) FROM \"{schema}\".outbox");
    loop {
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(count_sql.clone()))
            .fetch_one(pool)
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    task.await??;
    drop_queue(&conn, &name).await?;
    drop_schema(pool, &schema).await?;
    Ok(rate)
}

/// Transactions per second of 8 writers, each inserting one business row
/// and (with `mode`) one event, for `secs`.
async fn write_path(pool: &PgPool, mode: Option<Wakeup>, secs: f64) -> Result<f64> {
    let schema = fresh_schema(pool, "write").await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".orders (id bigserial PRIMARY KEY, sku text NOT NULL, qty int NOT NULL)"
    )))
    .execute(pool)
    .await?;
    let ob = match mode {
        Some(m) => {
            Some(Outbox::new(pool, OutboxConfig::default().schema(&schema).wakeup(m)).await?)
        }
        None => None,
    };
    let insert = format!("INSERT INTO \"{schema}\".orders (sku, qty) VALUES ($1, $2)");
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..8 {
        let pool = pool.clone();
        let ob = ob.clone();
        let insert = insert.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let mut tx = pool.begin().await?;
                sqlx::query(AssertSqlSafe(insert.clone()))
                    .bind("A-1")
                    .bind(w)
                    .execute(&mut *tx)
                    .await?;
                match &ob {
                    Some(ob) => {
                        ob.enqueue(
                            &mut *tx,
                            NewEvent::new(
                                "order",
                                n.to_string(),
                                "OrderPlaced",
                                &json!({"qty": w}),
                            )?,
                        )
                        .await?;
                        ob.commit(tx).await?;
                    }
                    None => tx.commit().await?,
                }
                n += 1;
            }
            Ok::<_, anyhow::Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    drop_schema(pool, &schema).await?;
    Ok(total as f64 / secs)
}

/// Commit-to-publish latency: a producer commits 1,000 events/s (wake-up
/// after commit), the relay publishes, a consumer notes arrival.
async fn publish_latency(pool: &PgPool, url: &str, secs: f64) -> Result<Vec<(String, f64)>> {
    let schema = fresh_schema(pool, "lat").await?;
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let name = format!("bench.lat.{}", suffix());
    topology(&conn, &name).await?;
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let ch = conn.create_channel().await?;
    let mut consumer = ch
        .basic_consume(
            name.as_str().into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let consume = tokio::spawn({
        let committed = committed.clone();
        let latencies = latencies.clone();
        async move {
            while let Some(Ok(d)) = consumer.next().await {
                let now = Instant::now();
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                let _ = d.acker.ack(BasicAckOptions::default()).await;
                // The commit instant is recorded right after COMMIT returns;
                // if the message wins that race, it counts as 0.
                let at = committed.lock().unwrap().get(&id).copied();
                latencies.lock().unwrap().push(at.map_or(0.0, |t| {
                    now.saturating_duration_since(t).as_secs_f64() * 1e3
                }));
            }
        }
    });
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let relay = Relay::new(
        relay_pool,
        RelayConfig {
            amqp_url: url.to_owned(),
            schema: schema.clone(),
            default_exchange: name.clone(),
            declare_exchange: None,
            ..RelayConfig::default()
        },
    )
    .await?;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let relay = relay.clone();
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // relay connected and listening
    let ob = Outbox::new(pool, OutboxConfig::default().schema(&schema)).await?;
    let total = (secs * 1000.0) as usize;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    for i in 0..total {
        tick.tick().await;
        let mut tx = pool.begin().await?;
        let id = ob
            .enqueue(
                &mut *tx,
                NewEvent::new("order", i.to_string(), "OrderPlaced", &payload())?,
            )
            .await?;
        ob.commit(tx).await?;
        committed
            .lock()
            .unwrap()
            .insert(id.to_string(), Instant::now());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while latencies.lock().unwrap().len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await??;
    consume.abort();
    let mut l = latencies.lock().unwrap().clone();
    anyhow::ensure!(
        l.len() >= total,
        "only {} of {total} events arrived",
        l.len()
    );
    l.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)];
    drop_queue(&conn, &name).await?;
    drop_schema(pool, &schema).await?;
    Ok(vec![
        ("publish_latency_p50_ms".into(), pct(0.50)),
        ("publish_latency_p95_ms".into(), pct(0.95)),
        ("publish_latency_p99_ms".into(), pct(0.99)),
    ])
}
