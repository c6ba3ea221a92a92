//! Shared set-up: fresh schemas, queues and payloads per measurement.

use std::time::Duration;

use anyhow::Result;
use lapin::options::{
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use outbox::{NewEvent, Ordering, Outbox, OutboxConfig, Wakeup};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};

/// Payload size of every benchmark event, in bytes of JSON.
pub(crate) const PAYLOAD_BYTES: usize = 500;

pub(crate) fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

pub(crate) fn payload() -> Value {
    json!({ "pad": "x".repeat(PAYLOAD_BYTES - 10) })
}

pub(crate) async fn connect(url: &str) -> Result<Connection> {
    Ok(Connection::connect(url, ConnectionProperties::default()).await?)
}

/// A durable topic exchange `name` and durable queue `name` bound with `#`.
pub(crate) async fn topology(conn: &Connection, name: &str) -> Result<()> {
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
    bind_queue(conn, name, name).await
}

/// A durable queue `queue` bound to `exchange` with `#`.
pub(crate) async fn bind_queue(conn: &Connection, exchange: &str, queue: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), q, FieldTable::default())
        .await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

pub(crate) async fn drop_queue(conn: &Connection, name: &str) -> Result<()> {
    let ch = conn.create_channel().await?;
    ch.queue_delete(name.into(), QueueDeleteOptions::default())
        .await?;
    let _ = ch.exchange_delete(name.into(), Default::default()).await;
    Ok(())
}

pub(crate) async fn fresh_schema(pool: &PgPool, prefix: &str) -> Result<String> {
    let schema = format!("bench_{prefix}_{}", suffix());
    outbox::migrate(pool, &schema).await?;
    Ok(schema)
}

pub(crate) async fn drop_schema(pool: &PgPool, schema: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(pool)
        .await?;
    Ok(())
}

/// Fills the outbox of `schema` with `n` events over `aggregates`
/// aggregates (round robin), 1,000 per statement; `ordering` says which are
/// ordered.
pub(crate) async fn fill_outbox(
    pool: &PgPool,
    schema: &str,
    n: usize,
    ordering: Ordering,
    aggregates: usize,
) -> Result<()> {
    if ordering == Ordering::All {
        outbox::set_ordered(pool, schema, outbox::ALL_TYPES, true).await?;
    }
    let ob = Outbox::new(
        pool,
        OutboxConfig::default()
            .schema(schema)
            .wakeup(Wakeup::PollOnly)
            .ordering(ordering),
    )
    .await?;
    let body = payload();
    for start in (0..n).step_by(1000) {
        let events = (start..(start + 1000).min(n))
            .map(|i| {
                NewEvent::new(
                    "order",
                    format!("o-{}", i % aggregates.max(1)),
                    "OrderPlaced",
                    &body,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut tx = pool.begin().await?;
        ob.enqueue_many(&mut *tx, events).await?;
        tx.commit().await?;
    }
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE \"{schema}\".outbox")))
        .execute(pool)
        .await?;
    Ok(())
}

pub(crate) async fn outbox_len(pool: &PgPool, schema: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".outbox"
    )))
    .fetch_one(pool)
    .await?)
}

/// Waits until the outbox of `schema` has at most `left` events.
pub(crate) async fn wait_outbox_at_most(pool: &PgPool, schema: &str, left: i64) -> Result<()> {
    while outbox_len(pool, schema).await? > left {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Peak resident set of a process, MiB (Linux `VmHWM`).
pub(crate) fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds (user + system) used so far by the processes whose command
/// name starts with `comm` (`postgres`, `beam.smp`), or by `pid` itself.
pub(crate) fn cpu_seconds(comm: Option<&str>, pid: Option<u32>) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return f64::NAN;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(p) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid.is_some_and(|want| want != p) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name; it may hold spaces.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if let Some(c) = comm
            && !stat[open + 1..close].starts_with(c)
        {
            continue;
        }
        let rest: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let utime: f64 = rest.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        let stime: f64 = rest.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        total += (utime + stime) / ticks;
    }
    total
}

/// CPU use of the broker, the database and one more process over a span.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSpan {
    broker: f64,
    database: f64,
    client: f64,
    client_pid: u32,
}

impl CpuSpan {
    pub(crate) fn start(client_pid: u32) -> Self {
        Self {
            broker: cpu_seconds(Some("beam.smp"), None),
            database: cpu_seconds(Some("postgres"), None),
            client: cpu_seconds(None, Some(client_pid)),
            client_pid,
        }
    }

    /// (broker, database, client) CPU seconds since `start`.
    pub(crate) fn stop(&self) -> (f64, f64, f64) {
        (
            cpu_seconds(Some("beam.smp"), None) - self.broker,
            cpu_seconds(Some("postgres"), None) - self.database,
            cpu_seconds(None, Some(self.client_pid)) - self.client,
        )
    }
}
