//! Operator views and actions: backlog status and the dead-letter table.

use chrono::{DateTime, Utc};
use outbox::Ident;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::error::Result;

/// The outbox at a glance (`outbox-relay status`).
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Events in the outbox (due or waiting for a retry).
    pub backlog: i64,
    /// Events due now.
    pub due: i64,
    /// Age in seconds of the oldest event in the outbox.
    pub oldest_pending_age_s: Option<f64>,
    /// Events that failed at least once and wait for their next attempt.
    pub retrying: i64,
    /// Events in the dead-letter table.
    pub dead_letters: i64,
    /// The retrying events with the most attempts, and why they failed.
    pub failing: Vec<FailingEvent>,
}

/// An event being retried.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FailingEvent {
    /// Event id.
    pub id: Uuid,
    /// Event type.
    pub event_type: String,
    /// Exchange (`None`: the relay's default).
    pub exchange: Option<String>,
    /// Routing key (`None`: `<aggregate_type>.<event_type>`).
    pub routing_key: Option<String>,
    /// Failed attempts so far.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When it is tried again.
    pub next_attempt_at: DateTime<Utc>,
}

/// A dead-lettered event.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Event id.
    pub id: Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made.
    pub attempts: i32,
    /// Why it was dead-lettered.
    pub last_error: String,
    /// When the event was created.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
}

/// Which dead letters an action applies to.
#[derive(Debug, Clone)]
pub enum Selection {
    /// Every dead letter.
    All,
    /// These ids.
    Ids(Vec<Uuid>),
}

impl Selection {
    fn ids(&self) -> Option<&[Uuid]> {
        match self {
            Selection::All => None,
            Selection::Ids(ids) => Some(ids),
        }
    }
}

/// What a replay did.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    /// Events put back in the outbox.
    pub replayed: u64,
    /// Replayed events created before the retention window: consumers may
    /// have forgotten them already and would apply them again.
    pub older_than_retention: Vec<Uuid>,
}

/// Reads the outbox status of `schema`.
pub async fn status(pool: &PgPool, schema: &Ident) -> Result<Status> {
    let s = schema.quoted();
    let (backlog, due, oldest, retrying): (i64, i64, Option<f64>, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*),
                count(*) FILTER (WHERE available_at <= now()),
                extract(epoch FROM now() - min(created_at))::float8,
                count(*) FILTER (WHERE attempts > 0)
         FROM {s}.outbox"
        )))
        .fetch_one(pool)
        .await?;
    let dead_letters: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.outbox_dead_letters"
    )))
    .fetch_one(pool)
    .await?;
    let failing = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, event_type, exchange, routing_key, attempts, last_error, available_at AS next_attempt_at
         FROM {s}.outbox WHERE attempts > 0 ORDER BY attempts DESC, available_at LIMIT 10"
    )))
    .fetch_all(pool)
    .await?;
    Ok(Status {
        backlog,
        due,
        oldest_pending_age_s: oldest,
        retrying,
        dead_letters,
        failing,
    })
}

/// Lists up to `limit` dead letters, newest first.
pub async fn list_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, dead_lettered_at
         FROM {}.outbox_dead_letters ORDER BY dead_lettered_at DESC LIMIT $1",
        schema.quoted()
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Puts dead letters back in the outbox, due now with attempts reset, in
/// one transaction. The event keeps its id, so consumers still deduplicate
/// it. Events older than `retention` are replayed but reported.
pub async fn replay_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    retention: std::time::Duration,
) -> Result<Replayed> {
    let s = schema.quoted();
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "WITH d AS (DELETE FROM {s}.outbox_dead_letters WHERE $1::uuid[] IS NULL OR id = ANY($1) RETURNING *)
         INSERT INTO {s}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange,
                                 routing_key, created_at, available_at, attempts, last_error, error_history)
         SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                created_at, now(), 0, NULL,
                error_history || jsonb_build_array(jsonb_build_object('at', now(), 'error', 'replayed from dead letters'))
         FROM d
         ON CONFLICT (id) DO NOTHING
         RETURNING id, created_at < now() - $2 * interval '1 millisecond'"
    )))
    .bind(selection.ids())
    .bind(retention.as_millis() as i64)
    .fetch_all(pool)
    .await?;
    let older: Vec<Uuid> = rows
        .iter()
        .filter(|(_, old)| *old)
        .map(|(id, _)| *id)
        .collect();
    if !older.is_empty() {
        tracing::warn!(
            count = older.len(),
            "replayed events older than the retention window: consumers may have forgotten them and apply them again"
        );
    }
    Ok(Replayed {
        replayed: rows.len() as u64,
        older_than_retention: older,
    })
}

/// Deletes dead letters for good. Returns how many.
pub async fn purge_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
) -> Result<u64> {
    Ok(sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {}.outbox_dead_letters WHERE $1::uuid[] IS NULL OR id = ANY($1)",
        schema.quoted()
    )))
    .bind(selection.ids())
    .execute(pool)
    .await?
    .rows_affected())
}
