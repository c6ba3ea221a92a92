//! Inbox retention: day partitions dropped whole, the rest in small chunks,
//! never past the live redelivery horizon.
//!
//! The inbox is partitioned by the time its dedup key carries (migration 3,
//! `inbox_event_time`). Retention drops a day partition once the day ended
//! more than the window ago **and** no parked copy (a message sent to the
//! retry or dead-letter queue, `inbox_parked`) dates from it or later: a
//! drop is one short lock, whatever the day's size. Records outside the day
//! partitions (keys that carry no time, times outside the prepared days,
//! and version 1's table `inbox`) are deleted by `processed_at` in
//! chunks of at most 1,000 rows, with the same horizon.
//!
//! The rule stays: the window must exceed every horizon within which a
//! message can come back that the consumer cannot see (the producer's relay
//! republishing after a long outage, a replay from an archive). What it can
//! see, the parked copies, holds retention back, and it says so.

use outbox_core::amqp::BrokerError;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::{Template, render};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::ConsumerConfig;
use crate::error::{Error, Result};

/// Default retention window: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Day partitions prepared ahead of today (UTC), by the migration, by each
/// consumer at its start and every hour, and by every retention pass.
pub const DAYS_AHEAD: i32 = 7;

/// Rows deleted per statement where a whole day cannot be dropped, so
/// cleanup never holds long locks or builds one huge transaction.
const CHUNK: i64 = 1_000;

/// A parked copy younger than this is kept even when its queues look
/// empty: the consumer commits the park before it republishes the copy.
const PARK_GRACE: Duration = Duration::from_secs(300);

/// What one retention pass did, and what held it back.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Day partitions dropped (`inbox_pYYYYMMDD`).
    pub days_dropped: Vec<String>,
    /// Their rows, as PostgreSQL's statistics estimate them (counting a
    /// day before dropping it would read it whole).
    pub day_rows_estimate: u64,
    /// Rows deleted in chunks (keys without a time, times outside the
    /// prepared days, version 1's table).
    pub rows_deleted: u64,
    /// Day partitions prepared ahead.
    pub days_prepared: u32,
    /// The live redelivery horizon, when it is younger than the window's
    /// cutoff: retention kept what a parked copy could still meet.
    pub held: Option<Held>,
}

impl RetentionReport {
    /// Rows removed: deleted, plus the estimate of the days dropped.
    pub fn removed(&self) -> u64 {
        self.rows_deleted + self.day_rows_estimate
    }
}

/// Parked copies (messages sent to the retry or dead-letter queue) that
/// hold retention back.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Held {
    /// How many copies are parked (every consumer name of the schema:
    /// a day partition holds them all).
    pub parked: i64,
    /// The oldest time their keys carry (`None`: none carries one).
    pub oldest_event_at: Option<DateTime<Utc>>,
    /// When the oldest was parked.
    pub oldest_parked_at: DateTime<Utc>,
}

/// One retention pass over `schema`'s inbox with the window `older_than`:
/// prepares the days ahead, drops the days past both the window and the
/// parked copies, and deletes, in chunks of at most 1,000 rows, the
/// records of `consumer` (every consumer when `None`) outside the days.
/// Day partitions hold every consumer name's records, so `consumer` does
/// not limit which days go.
pub async fn inbox_retention(
    pool: &PgPool,
    schema: &str,
    consumer: Option<&str>,
    older_than: Duration,
) -> Result<RetentionReport> {
    let s = Ident::new("schema", schema)?;
    let mut report = RetentionReport {
        days_prepared: prepare_days(pool, &s).await?,
        ..RetentionReport::default()
    };
    let window = chrono::Duration::from_std(older_than).unwrap_or(chrono::TimeDelta::MAX);
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(pool).await?;
    let cutoff = now
        .checked_sub_signed(window)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let held = parked(pool, &s).await?;
    // A day goes when it ended before the cutoff and before the oldest
    // parked key's time; a chunked record when it was processed before the
    // cutoff and (slack for the clocks) an hour before the oldest park.
    let (days_before, rows_before) = match &held {
        Some(h) => {
            let days = h.oldest_event_at.map_or(cutoff, |t| t.min(cutoff));
            let rows = (h.oldest_parked_at - chrono::Duration::hours(1)).min(cutoff);
            (days, rows)
        }
        None => (cutoff, cutoff),
    };
    // Held back: what the parked copies keep reaches past the window.
    if days_before < cutoff || rows_before < cutoff {
        report.held = held;
    }
    let (dropped, estimate) = drop_days(pool, &s, days_before).await?;
    report.days_dropped = dropped;
    report.day_rows_estimate = estimate;
    for table in ["inbox_untimed", "inbox_other", "inbox"] {
        report.rows_deleted += delete_chunks(pool, &s, table, consumer, rows_before).await?;
    }
    if let Some(h) = &report.held {
        tracing::warn!(
            schema,
            parked = h.parked,
            oldest_event_at = ?h.oldest_event_at,
            oldest_parked_at = %h.oldest_parked_at,
            "inbox retention waits: copies parked in the retry or dead-letter queue could meet records past the window; \
             it keeps them until the copies are consumed (docs/INBOX_TABLE.md, \"Retention\")"
        );
    }
    if report.removed() > 0 {
        tracing::info!(
            schema,
            consumer,
            days = ?report.days_dropped,
            deleted = report.rows_deleted,
            "inbox retention"
        );
    }
    metrics::counter!("outbox_consumer_inbox_deleted_total").increment(report.removed());
    metrics::gauge!("outbox_consumer_inbox_retention_held").set(if report.held.is_some() {
        1.0
    } else {
        0.0
    });
    Ok(report)
}

/// [`inbox_retention`], returning how many records it removed (the days
/// dropped counted by PostgreSQL's estimate). Kept for version 1's callers.
pub async fn cleanup_inbox(
    pool: &PgPool,
    schema: &str,
    consumer: Option<&str>,
    older_than: Duration,
) -> Result<u64> {
    Ok(inbox_retention(pool, schema, consumer, older_than)
        .await?
        .removed())
}

/// Prepares the day partitions from today to [`DAYS_AHEAD`] days later
/// (`inbox_prepare_days`); returns how many it attached.
pub(crate) async fn prepare_days(pool: &PgPool, s: &Ident) -> Result<u32> {
    let sql = render("SELECT {schema}.inbox_prepare_days($1)", s);
    let made: i32 = sqlx::query_scalar(sql)
        .bind(DAYS_AHEAD)
        .fetch_one(pool)
        .await?;
    Ok(u32::try_from(made).unwrap_or(0))
}

/// The parked copies of every consumer name, or `None` when there are none.
async fn parked(pool: &PgPool, s: &Ident) -> Result<Option<Held>> {
    let sql = render(include_str!("retention/parked.sql"), s);
    let (n, event_at, parked_at): (i64, Option<DateTime<Utc>>, Option<DateTime<Utc>>) =
        sqlx::query_as(sql).fetch_one(pool).await?;
    Ok(parked_at.filter(|_| n > 0).map(|oldest_parked_at| Held {
        parked: n,
        oldest_event_at: event_at,
        oldest_parked_at,
    }))
}

/// Drops the day partitions ending at or before `before`; returns their
/// names and the rows PostgreSQL estimates they held.
async fn drop_days(pool: &PgPool, s: &Ident, before: DateTime<Utc>) -> Result<(Vec<String>, u64)> {
    // The estimate first: a dropped table has no statistics left.
    let estimate = render(include_str!("retention/day_rows.sql"), s);
    let rows: i64 = sqlx::query_scalar(estimate)
        .bind(before)
        .fetch_one(pool)
        .await?;
    let sql = render("SELECT {schema}.inbox_drop_days($1)", s);
    let dropped: Vec<String> = sqlx::query_scalar(sql).bind(before).fetch_all(pool).await?;
    let rows = if dropped.is_empty() {
        0
    } else {
        u64::try_from(rows).unwrap_or(0)
    };
    Ok((dropped, rows))
}

/// Deletes `table`'s records processed before `before`, at most [`CHUNK`]
/// rows a statement, walking `processed_at` forward (a statement does
/// not walk the dead entries of the ones before it, apart from rows that
/// share a boundary's time).
async fn delete_chunks(
    pool: &PgPool,
    s: &Ident,
    table: &str,
    consumer: Option<&str>,
    before: DateTime<Utc>,
) -> Result<u64> {
    let sql = Template::new(include_str!("retention/delete_chunk.sql"), s)
        .with("table", table)
        .render();
    Ok(
        outbox_core::db::delete_in_chunks(pool, CHUNK, |cursor, chunk| {
            sqlx::query_as(sql.clone())
                .bind(cursor)
                .bind(before)
                .bind(consumer)
                .bind(chunk)
        })
        .await?,
    )
}

/// Forgets the parked copies of `consumer` parked before `before`: its
/// retry and dead-letter queues were seen empty, so those copies were
/// consumed (or purged). Returns how many.
async fn release_parked(
    pool: &PgPool,
    s: &Ident,
    consumer: &str,
    before: DateTime<Utc>,
) -> Result<u64> {
    let sql = render(
        "DELETE FROM {schema}.inbox_parked WHERE consumer = $1 AND parked_at < $2",
        s,
    );
    Ok(sqlx::query(sql)
        .bind(consumer)
        .bind(before)
        .execute(pool)
        .await?
        .rows_affected())
}

/// A background service running [`inbox_retention`] periodically.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetentionTask {
    pool: PgPool,
    schema: String,
    consumer: Option<String>,
    /// Built by [`RetentionTask::for_consumer`]: the consumer whose retry
    /// and dead-letter queues each pass looks at.
    queues: Option<Box<ConsumerConfig>>,
    /// Records older than this are deleted. Default [`DEFAULT_RETENTION`].
    pub window: Duration,
    /// Pause between runs. Default 1 hour.
    pub interval: Duration,
}

impl RetentionTask {
    /// Retention of `schema`'s inbox (one consumer's chunked records, or
    /// all). It does not look at the broker: a parked copy holds
    /// retention back until [`RetentionTask::for_consumer`] (or an
    /// operator, docs/INBOX_TABLE.md) releases it.
    pub fn new(pool: PgPool, schema: impl Into<String>, consumer: Option<String>) -> Self {
        Self {
            pool,
            schema: schema.into(),
            consumer,
            queues: None,
            window: DEFAULT_RETENTION,
            interval: Duration::from_secs(3600),
        }
    }

    /// Retention for the consumer `config` describes: each pass first looks
    /// at its retry and dead-letter queues, and when both are empty
    /// releases the copies it parked there (older than five minutes: the
    /// consumer commits a park before it republishes the copy).
    pub fn for_consumer(pool: PgPool, config: &ConsumerConfig) -> Self {
        Self {
            queues: Some(Box::new(config.clone())),
            ..Self::new(
                pool,
                config.schema.clone(),
                Some(config.consumer_name.clone()),
            )
        }
    }

    /// One retention pass.
    pub async fn run_once(&self) -> Result<RetentionReport> {
        if let Some(config) = &self.queues {
            let s = Ident::new("schema", &self.schema)?;
            let seen: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
                .fetch_one(&self.pool)
                .await?;
            if queues_empty(config).await? {
                let grace = chrono::Duration::from_std(PARK_GRACE).unwrap_or_default();
                let released =
                    release_parked(&self.pool, &s, &config.consumer_name, seen - grace).await?;
                if released > 0 {
                    tracing::info!(
                        consumer = %config.consumer_name,
                        released,
                        "inbox retention: the retry and dead-letter queues are empty; their parked copies are released"
                    );
                }
            }
        }
        inbox_retention(
            &self.pool,
            &self.schema,
            self.consumer.as_deref(),
            self.window,
        )
        .await
    }

    /// Runs a pass every `interval` until `shutdown`. Errors are logged and
    /// the next pass tries again.
    pub async fn run(&self, shutdown: CancellationToken) {
        loop {
            if let Err(e) = self.run_once().await {
                tracing::warn!(error = %e, schema = %self.schema, "inbox retention failed; will retry");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

/// Whether `config`'s retry and dead-letter queues hold no message ready
/// (a passive declare of each: nothing is created or changed). A queue
/// that cannot be looked at (missing, the broker away) counts as holding
/// some: the parked copies stay.
async fn queues_empty(config: &ConsumerConfig) -> Result<bool> {
    let names = [config.retry_queue(), config.dead_letter_queue()];
    let bound = config.broker_timeout;
    crate::topology::at_any_node(&config.amqp_url, bound, async |conn| {
        for name in &names {
            let passive = lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let declared = tokio::time::timeout(bound, async {
                let channel = conn.create_channel().await?;
                channel
                    .queue_declare(name.as_str().into(), passive, Default::default())
                    .await
            })
            .await;
            match declared {
                Ok(Ok(q)) if q.message_count() == 0 => {}
                Ok(Ok(_)) => return Ok(false),
                Ok(Err(e)) => {
                    tracing::debug!(queue = %name, error = %e, "inbox retention could not look at a queue");
                    return Ok(false);
                }
                Err(_) => {
                    return Err(Error::Broker(BrokerError::TimedOut {
                        what: "queue.declare (passive)",
                        timeout: bound,
                    }));
                }
            }
        }
        Ok(true)
    })
    .await
}

/// Prepares the day partitions at the consumer's start and then every
/// hour until `stop`, so records land in day partitions even where no
/// retention task runs. Failures are logged; the next hour tries again.
pub(crate) async fn prepare_days_hourly(pool: PgPool, schema: Ident, stop: CancellationToken) {
    loop {
        if let Err(e) = prepare_days(&pool, &schema).await {
            tracing::warn!(error = %e, schema = %schema, "preparing the inbox's day partitions failed; will retry");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}
