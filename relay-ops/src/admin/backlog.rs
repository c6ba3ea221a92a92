//! The outbox itself, read-only and cheap on any size: the oldest events
//! by due time, the backlog per event type, and the publish rate the
//! relays record per minute (the console's Overview and Outbox pages).

use chrono::{DateTime, Utc};
use outbox::Ident;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use super::Result;
use super::status::{EXACT_COUNT_UP_TO, estimated_rows};

/// An event waiting in the outbox.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct PendingEvent {
    /// Event id.
    pub id: Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made so far.
    pub attempts: i32,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it is (or was) due.
    pub available_at: DateTime<Utc>,
    /// Why its last attempt failed, if one did.
    pub last_error: Option<String>,
}

/// The `limit` unordered events due first (the relay's claim order), from
/// the claim index. Ordered events wait in their aggregates' order instead:
/// the blocked ones are listed by [`blocked_aggregates`](crate::admin::blocked_aggregates).
pub async fn oldest_due(pool: &PgPool, schema: &Ident, limit: i64) -> Result<Vec<PendingEvent>> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregate_type, aggregate_id, event_type, attempts, created_at, available_at, last_error
         FROM {}.outbox WHERE aggregate_seq IS NULL ORDER BY available_at, id LIMIT $1",
        schema.quoted()
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Events in the outbox per type.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TypeBacklog {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Event type.
    pub event_type: String,
    /// Events of this type (an estimate when [`BacklogByType::exact`] is false).
    pub events: i64,
}

/// The backlog per event type, most first.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct BacklogByType {
    /// Counted row by row (an outbox of at most [`EXACT_COUNT_UP_TO`]
    /// rows), or estimated from a sample of the table's pages.
    pub exact: bool,
    /// Per type, most events first.
    pub types: Vec<TypeBacklog>,
}

/// How many rows a sampled estimate reads, about.
const SAMPLE_ROWS: f64 = 20_000.0;

/// The backlog per event type: exact on an outbox of at most
/// [`EXACT_COUNT_UP_TO`] rows (by the planner's estimate, scaled to the
/// table's current size), otherwise from a
/// `TABLESAMPLE SYSTEM` of about 20,000 rows scaled to the estimated row
/// count, so the cost stays the same on any size of outbox.
pub async fn backlog_by_type(pool: &PgPool, schema: &Ident) -> Result<BacklogByType> {
    let s = schema.quoted();
    let estimate: f64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce({}, 0)",
        estimated_rows(&s, "outbox")
    )))
    .fetch_one(pool)
    .await?;
    let exact = estimate <= EXACT_COUNT_UP_TO as f64;
    let rows: Vec<(String, String, i64)> = if exact {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT aggregate_type, event_type, count(*) FROM {s}.outbox
             GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 100"
        )))
        .fetch_all(pool)
        .await?
    } else {
        let percent = (SAMPLE_ROWS * 100.0 / estimate).min(100.0);
        sqlx::query_as(AssertSqlSafe(format!(
            "WITH s AS (SELECT aggregate_type, event_type FROM {s}.outbox TABLESAMPLE SYSTEM ($1)),
                  n AS (SELECT greatest(count(*), 1)::float8 AS total FROM s)
             SELECT aggregate_type, event_type, round(count(*) * $2 / (SELECT total FROM n))::bigint
             FROM s GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 100"
        )))
        .bind(percent as f32)
        .bind(estimate)
        .fetch_all(pool)
        .await?
    };
    Ok(BacklogByType {
        exact,
        types: rows
            .into_iter()
            .map(|(aggregate_type, event_type, events)| TypeBacklog {
                aggregate_type,
                event_type,
                events,
            })
            .collect(),
    })
}

/// Events the relays settled in one minute.
#[derive(Debug, Clone, Copy, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct MinuteRate {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// Events published (confirmed by the broker).
    pub published: i64,
    /// Events dead-lettered.
    pub dead_lettered: i64,
}

/// The last `minutes` minutes of `outbox_publish_stats`, oldest first, one
/// entry per minute (zero where no relay recorded anything).
pub async fn publish_rates(pool: &PgPool, schema: &Ident, minutes: i32) -> Result<Vec<MinuteRate>> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT m.minute, coalesce(p.published, 0) AS published, coalesce(p.dead_lettered, 0) AS dead_lettered
         FROM generate_series(date_trunc('minute', now()) - ($1 - 1) * interval '1 minute',
                              date_trunc('minute', now()), interval '1 minute') AS m(minute)
         LEFT JOIN {}.outbox_publish_stats p ON p.minute = m.minute
         ORDER BY m.minute",
        schema.quoted()
    )))
    .bind(minutes)
    .fetch_all(pool)
    .await?)
}
