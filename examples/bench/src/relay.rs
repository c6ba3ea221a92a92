//! The relay against the raw ceiling: drain rate, cost growth, latency.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use outbox::{NewEvent, Ordering, Outbox, OutboxConfig};
use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome};
use outbox_relay::{Relay, RelayConfig};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// Persistent, mandatory, confirmed publishes with plain lapin, 500
/// confirms in flight per window (the relay's batch size), same payload
/// size and same kind of queue as the relay's.
pub(crate) async fn raw_publish_rate(url: &str, n: usize) -> Result<(f64, (f64, f64, f64))> {
    let conn = connect(url).await?;
    let name = format!("bench.raw.{}", suffix());
    topology(&conn, &name).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = serde_json::to_vec(&payload())?;
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let cpu = CpuSpan::start(std::process::id());
    let started = Instant::now();
    for start in (0..n).step_by(500) {
        let mut confirms = Vec::with_capacity(500);
        for _ in start..(start + 500).min(n) {
            let props = BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_type("OrderPlaced".into())
                .with_delivery_mode(2)
                .with_content_type("application/json".into());
            confirms.push(
                ch.basic_publish(
                    name.as_str().into(),
                    "order.OrderPlaced".into(),
                    opts,
                    &body,
                    props,
                )
                .await?,
            );
        }
        for c in confirms {
            anyhow::ensure!(c.await? == Confirmation::Ack(None), "raw publish not acked");
        }
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.stop();
    drop_queue(&conn, &name).await?;
    Ok((rate, cpu))
}

fn relay_config(url: &str, schema: &str, exchange: &str) -> RelayConfig {
    RelayConfig {
        amqp_url: url.to_owned(),
        schema: schema.to_owned(),
        default_exchange: exchange.to_owned(),
        declare_exchange: None,
        poll_interval: std::env::var("BENCH_POLL_MS")
            .ok()
            .and_then(|w| w.parse().ok())
            .map_or(RelayConfig::default().poll_interval, Duration::from_millis),
        workers: std::env::var("BENCH_RELAY_WORKERS")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(RelayConfig::default().workers),
        ..RelayConfig::default()
    }
}

/// Drains `measure` events out of a backlog of `backlog` (over 1,000
/// aggregates) with `relays` in-process relays (default settings); events
/// per second.
pub(crate) async fn drain_rate(
    pool: &PgPool,
    url: &str,
    backlog: usize,
    measure: usize,
    relays: usize,
    ordering: Ordering,
) -> Result<f64> {
    drain_rate_over(pool, url, backlog, measure, relays, ordering, 1_000).await
}

/// [`drain_rate`] with the backlog spread over `aggregates` aggregates.
pub(crate) async fn drain_rate_over(
    pool: &PgPool,
    url: &str,
    backlog: usize,
    measure: usize,
    relays: usize,
    ordering: Ordering,
    aggregates: usize,
) -> Result<f64> {
    let schema = fresh_schema(pool, "drain").await?;
    let conn = connect(url).await?;
    let name = format!("bench.drain.{}", suffix());
    topology(&conn, &name).await?;
    fill_outbox(pool, &schema, backlog, ordering, aggregates).await?;
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let started = Instant::now();
    for _ in 0..relays {
        let relay_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with((*pool.connect_options()).clone())
            .await?;
        let relay = Relay::new(relay_pool, relay_config(url, &schema, &name)).await?;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move { relay.run(stop).await }));
    }
    wait_outbox_at_most(pool, &schema, (backlog - measure) as i64).await?;
    let rate = measure as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    for t in tasks {
        t.await??;
    }
    drop_queue(&conn, &name).await?;
    drop_schema(pool, &schema).await?;
    Ok(rate)
}

/// The `outbox-relay` binary draining `n` events: (events/s, peak RSS MiB,
/// CPU seconds of broker, database and relay).
pub(crate) async fn drain_process(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
) -> Result<(f64, f64, (f64, f64, f64))> {
    let bin = std::env::current_exe()?.with_file_name("outbox-relay");
    anyhow::ensure!(
        bin.exists(),
        "{} missing: build it with `cargo build --release -p relay-bin`",
        bin.display()
    );
    let schema = fresh_schema(pool, "proc").await?;
    let conn = connect(url).await?;
    let name = format!("bench.proc.{}", suffix());
    topology(&conn, &name).await?;
    fill_outbox(pool, &schema, n, Ordering::None, 1_000).await?;
    let started = Instant::now();
    let mut child = Command::new(&bin)
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", url)
        .env("OUTBOX_SCHEMA", &schema)
        .env("OUTBOX_EXCHANGE", &name)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env("RUST_LOG", "warn")
        .arg("run")
        .stdout(Stdio::null())
        .spawn()
        .context("starting outbox-relay")?;
    let cpu = CpuSpan::start(child.id());
    wait_outbox_at_most(pool, &schema, 0).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.stop();
    let rss = peak_rss_mib(child.id()).unwrap_or(f64::NAN);
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    child.wait()?;
    drop_queue(&conn, &name).await?;
    drop_schema(pool, &schema).await?;
    Ok((rate, rss, cpu))
}

type Stamps = Arc<Mutex<HashMap<String, Instant>>>;

struct StampEffect {
    effects: Stamps,
}

impl Handler for StampEffect {
    async fn handle(&self, _: &mut PgConnection, event: &Event) -> Outcome {
        self.effects
            .lock()
            .unwrap()
            .insert(event.id().to_owned(), Instant::now());
        Outcome::Ack
    }
}

fn percentiles(prefix: &str, mut l: Vec<f64>) -> Vec<(String, f64)> {
    l.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    vec![
        (format!("{prefix}_p50_ms"), pct(0.50)),
        (format!("{prefix}_p95_ms"), pct(0.95)),
        (format!("{prefix}_p99_ms"), pct(0.99)),
    ]
}

/// Commit-to-publish (a plain consumer's receipt) and commit-to-effect (a
/// `consumer-lib` handler) at a steady offered load of 1,000 events/s,
/// with the default wake-up (`Wakeup::AfterCommit`).
pub(crate) async fn latency(pool: &PgPool, url: &str, secs: f64) -> Result<Vec<(String, f64)>> {
    let schema = fresh_schema(pool, "lat").await?;
    let consumer_schema = format!("{schema}_c");
    outbox_consumer::migrate(pool, &consumer_schema).await?;
    let conn = connect(url).await?;
    let name = format!("bench.lat.{}", suffix());
    topology(&conn, &name).await?;
    let effect_queue = format!("{name}.effects");
    bind_queue(&conn, &name, &effect_queue).await?;
    let committed: Stamps = Arc::default();
    let published: Stamps = Arc::default();
    let effects: Stamps = Arc::default();

    let ch = conn.create_channel().await?;
    let mut raw = ch
        .basic_consume(
            name.as_str().into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let raw_task = tokio::spawn({
        let published = published.clone();
        async move {
            while let Some(Ok(d)) = raw.next().await {
                let now = Instant::now();
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                published.lock().unwrap().insert(id, now);
                let _ = d.acker.ack(BasicAckOptions::default()).await;
            }
        }
    });
    let stop = CancellationToken::new();
    let mut cfg = ConsumerConfig::new(url, &effect_queue, "bench").schema(&consumer_schema);
    cfg.declare_retry_queues = false;
    let consumer = Consumer::new(
        cfg,
        pool.clone(),
        StampEffect {
            effects: effects.clone(),
        },
    )?;
    let consumer_task = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let relay = Relay::new(relay_pool, relay_config(url, &schema, &name)).await?;
    let relay_task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // connected and listening

    let wakeup = match std::env::var("BENCH_WAKEUP").as_deref() {
        Ok("in_transaction") => outbox::Wakeup::InTransaction,
        Ok("poll_only") => outbox::Wakeup::PollOnly,
        _ => outbox::Wakeup::AfterCommit,
    };
    let ob = Outbox::new(pool, OutboxConfig::default().schema(&schema).wakeup(wakeup)).await?;
    let total = (secs * 1000.0) as usize;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
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
    while (published.lock().unwrap().len() < total || effects.lock().unwrap().len() < total)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    relay_task.await??;
    consumer_task.await??;
    raw_task.abort();
    let committed = committed.lock().unwrap().clone();
    // The commit instant is taken right after COMMIT returns; a message
    // that wins that race counts as 0 ms.
    let since_commit = |stamps: &Stamps| -> Vec<f64> {
        stamps
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(id, t)| {
                committed
                    .get(id)
                    .map(|c| t.saturating_duration_since(*c).as_secs_f64() * 1e3)
            })
            .collect()
    };
    let publish = since_commit(&published);
    let effect = since_commit(&effects);
    anyhow::ensure!(
        publish.len() >= total && effect.len() >= total,
        "only {}/{} of {total} events arrived",
        publish.len(),
        effect.len()
    );
    drop_queue(&conn, &name).await?;
    drop_queue(&conn, &effect_queue).await?;
    drop_schema(pool, &schema).await?;
    drop_schema(pool, &consumer_schema).await?;
    let mut out = percentiles("publish_latency", publish);
    out.extend(percentiles("effect_latency", effect));
    Ok(out)
}
