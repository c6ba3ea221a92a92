//! The consumer: the library (per-event and batch handlers) against a raw
//! ack-only consumer and a hand-written batched dedup loop, over the same
//! messages.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection};
use outbox_consumer::{
    BatchHandler, BatchOutcome, Consumer, ConsumerConfig, Event, Handler, Outcome,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// Results of the consumer measurements.
pub(crate) struct ConsumerResults {
    pub(crate) per_event_per_s: f64,
    pub(crate) batch_per_s: f64,
    pub(crate) raw_ack_per_s: f64,
    pub(crate) hand_written_per_s: f64,
    pub(crate) peak_rss_mib: f64,
}

struct RelativeUpdate {
    schema: String,
}

impl Handler for RelativeUpdate {
    async fn handle(&self, conn: &mut PgConnection, _: &Event) -> Outcome {
        let sql = format!(
            "UPDATE \"{}\".stock SET qty = qty - 1 WHERE sku = 'A'",
            self.schema
        );
        match sqlx::query(AssertSqlSafe(sql)).execute(conn).await {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

struct SetUpdate {
    schema: String,
}

impl BatchHandler for SetUpdate {
    async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
        let sql = format!(
            "UPDATE \"{}\".stock SET qty = qty - $1 WHERE sku = 'A'",
            self.schema
        );
        match sqlx::query(AssertSqlSafe(sql))
            .bind(events.len() as i64)
            .execute(conn)
            .await
        {
            Ok(_) => BatchOutcome::All(Outcome::Ack),
            Err(e) => BatchOutcome::All(Outcome::Retry(e.to_string())),
        }
    }
}

async fn consumer_schema(pool: &PgPool) -> Result<String> {
    let schema = format!("bench_cons_{}", suffix());
    outbox_consumer::migrate(pool, &schema).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".stock (sku text PRIMARY KEY, qty bigint NOT NULL); INSERT INTO \"{schema}\".stock VALUES ('A', 0);"
    )))
    .execute(pool)
    .await?;
    Ok(schema)
}

async fn stock(pool: &PgPool, schema: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT -qty FROM \"{schema}\".stock"
    )))
    .fetch_one(pool)
    .await?)
}

/// Publishes `n` distinct persistent messages once to an exchange that
/// copies them to every queue in `queues`.
async fn preload(conn: &Connection, exchange: &str, queues: &[String], n: usize) -> Result<()> {
    topology(conn, exchange).await?;
    for q in queues {
        bind_queue(conn, exchange, q).await?;
    }
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = serde_json::to_vec(&payload())?;
    for start in (0..n).step_by(1000) {
        let mut confirms = Vec::new();
        for _ in start..(start + 1000).min(n) {
            let props = BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_type("OrderPlaced".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            confirms.push(
                ch.basic_publish(
                    exchange.into(),
                    "order.OrderPlaced".into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                )
                .await?,
            );
        }
        for c in confirms {
            anyhow::ensure!(
                c.await? == Confirmation::Ack(None),
                "preload publish not acked"
            );
        }
    }
    Ok(())
}

async fn library_rate(pool: &PgPool, url: &str, queue: &str, n: usize, batch: bool) -> Result<f64> {
    let schema = consumer_schema(pool).await?;
    let mut cfg = ConsumerConfig::new(url, queue, "bench").schema(&schema);
    cfg.declare_retry_queues = false;
    if let Some(ms) = std::env::var("BENCH_LINGER_MS")
        .ok()
        .and_then(|m| m.parse().ok())
    {
        cfg.batch_max_wait = Duration::from_millis(ms);
    }
    let consumer = if batch {
        Consumer::with_batch_handler(
            cfg,
            pool.clone(),
            SetUpdate {
                schema: schema.clone(),
            },
        )?
    } else {
        Consumer::new(
            cfg,
            pool.clone(),
            RelativeUpdate {
                schema: schema.clone(),
            },
        )?
    };
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn({
        let stop = stop.clone();
        let consumer = consumer.clone();
        async move { consumer.run(stop).await }
    });
    while stock(pool, &schema).await? < n as i64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    task.await??;
    drop_schema(pool, &schema).await?;
    Ok(rate)
}

async fn raw_ack_rate(url: &str, queue: &str, n: usize) -> Result<f64> {
    let conn = connect(url).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(256, BasicQosOptions::default()).await?;
    let mut c = ch
        .basic_consume(
            queue.into(),
            "raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let started = Instant::now();
    for _ in 0..n {
        let d = c.next().await.context("queue ended")??;
        d.acker.ack(BasicAckOptions::default()).await?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// What a careful engineer writes by hand: batch up to 128 deliveries or
/// 20 ms, dedup the batch in one statement, one set-based update, commit,
/// one multiple-ack.
async fn hand_written_rate(pool: &PgPool, url: &str, queue: &str, n: usize) -> Result<f64> {
    let schema = consumer_schema(pool).await?;
    let conn = connect(url).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(256, BasicQosOptions::default()).await?;
    let mut c = ch
        .basic_consume(
            queue.into(),
            "hand".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let dedup = format!(
        "INSERT INTO \"{schema}\".inbox (consumer, event_id) SELECT 'bench', unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING event_id"
    );
    let update = format!("UPDATE \"{schema}\".stock SET qty = qty - $1 WHERE sku = 'A'");
    let started = Instant::now();
    let mut done = 0;
    while done < n {
        let first = c.next().await.context("queue ended")??;
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + Duration::from_millis(20);
        while batch.len() < 128 {
            match tokio::time::timeout_at(until, c.next()).await {
                Ok(Some(d)) => batch.push(d?),
                _ => break,
            }
        }
        let ids: Vec<String> = batch
            .iter()
            .map(|d| {
                d.properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            })
            .collect();
        let mut tx = pool.begin().await?;
        let fresh: Vec<String> = sqlx::query_scalar(AssertSqlSafe(dedup.clone()))
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(update.clone()))
            .bind(fresh.len() as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let last = batch.last().expect("non-empty");
        last.acker.ack(BasicAckOptions { multiple: true }).await?;
        done += batch.len();
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop_schema(pool, &schema).await?;
    Ok(rate)
}

/// Runs every consumer measurement over `n` messages.
pub(crate) async fn measure(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
) -> Result<ConsumerResults> {
    let conn = connect(url).await?;
    let base = format!("bench.cons.{}", suffix());
    let names = [
        "hand1",
        "batch1",
        "raw1",
        "hand2",
        "batch2",
        "raw2",
        "per_event",
        "child",
    ];
    let queues: Vec<String> = names.iter().map(|q| format!("{base}.{q}")).collect();
    preload(&conn, &base, &queues, n).await?;
    // Short runs are noisy on a shared 2-core machine: measure the three
    // baselines twice, interleaved, and keep the best of each.
    let (mut hand, mut batch, mut raw) = (0f64, 0f64, 0f64);
    for round in 0..2 {
        hand = hand.max(hand_written_rate(pool, url, &queues[round * 3], n).await?);
        batch = batch.max(library_rate(pool, url, &queues[round * 3 + 1], n, true).await?);
        raw = raw.max(raw_ack_rate(url, &queues[round * 3 + 2], n).await?);
    }
    let per_event_per_s = library_rate(pool, url, &queues[6], n, false).await?;
    let peak_rss_mib = child_rss(database_url, url, &queues[7], n)?;
    for q in &queues {
        drop_queue(&conn, q).await?;
    }
    let _ = drop_queue(&conn, &base).await;
    Ok(ConsumerResults {
        per_event_per_s,
        batch_per_s: batch,
        raw_ack_per_s: raw,
        hand_written_per_s: hand,
        peak_rss_mib,
    })
}

/// Runs the per-event consumer in a child process (this binary with
/// `--child-consumer`) and reads its peak RSS before it exits.
fn child_rss(database_url: &str, url: &str, queue: &str, n: usize) -> Result<f64> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child-consumer", queue, &n.to_string()])
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("child stdout")?).read_line(&mut line)?;
    anyhow::ensure!(line.trim() == "done", "child consumer failed: {line:?}");
    let rss = peak_rss_mib(child.id()).unwrap_or(f64::NAN);
    drop(child.stdin.take());
    child.wait()?;
    Ok(rss)
}

/// The child side of [`child_rss`]: consume `n` messages, say `done`,
/// wait for stdin to close.
pub(crate) async fn child_consumer(pool: &PgPool, url: &str, queue: &str, n: usize) -> Result<()> {
    library_rate(pool, url, queue, n, false).await?;
    println!("done");
    std::io::stdout().flush()?;
    let mut sink = String::new();
    let _ = std::io::stdin().read_line(&mut sink);
    Ok(())
}
