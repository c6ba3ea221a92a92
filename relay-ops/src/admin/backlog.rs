//! The outbox itself, read-only and cheap on any size: the oldest events
//! by due time, the backlog per event type, and the publish rate the
//! relays record per minute (the console's Overview and Outbox pages).

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::{Template, render};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::Result;
use super::estimate::{estimated_rows, sample_percent};
use super::status::EXACT_COUNT_UP_TO;

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
    Ok(
        sqlx::query_as(render(include_str!("backlog/oldest_due.sql"), schema))
            .bind(limit)
            .fetch_all(pool)
            .await?,
    )
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

/// The backlog per event type: exact on an outbox of at most
/// [`EXACT_COUNT_UP_TO`] rows (by the planner's estimate, scaled to the
/// table's current size), otherwise from a `TABLESAMPLE SYSTEM` of about
/// 800 of its pages (the estimates' one sampling policy, `estimate.rs`)
/// scaled to the estimated row count, so the cost stays the same on any
/// size of outbox.
pub async fn backlog_by_type(pool: &PgPool, schema: &Ident) -> Result<BacklogByType> {
    let (estimate, percent): (f64, f32) = sqlx::query_as(
        Template::new(include_str!("backlog/estimate.sql"), schema)
            .with("estimated_rows", estimated_rows(schema, "outbox"))
            .with("sample_percent", sample_percent("r.size"))
            .render(),
    )
    .fetch_one(pool)
    .await?;
    let exact = estimate <= EXACT_COUNT_UP_TO as f64;
    let rows: Vec<(String, String, i64)> = if exact {
        sqlx::query_as(render(include_str!("backlog/by_type_exact.sql"), schema))
            .fetch_all(pool)
            .await?
    } else {
        sqlx::query_as(render(include_str!("backlog/by_type_sampled.sql"), schema))
            .bind(percent)
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
    Ok(
        sqlx::query_as(render(include_str!("backlog/publish_rates.sql"), schema))
            .bind(minutes)
            .fetch_all(pool)
            .await?,
    )
}
