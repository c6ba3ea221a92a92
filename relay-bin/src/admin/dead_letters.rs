//! The dead-letter table: list, replay into the outbox, purge
//! (`outbox-relay dead-letters`).

use chrono::{DateTime, Utc};
use outbox::Ident;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::error::Result;

/// A dead-lettered event.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
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
#[non_exhaustive]
pub struct Replayed {
    /// Events put back in the outbox.
    pub replayed: u64,
    /// Replayed events created before the retention window: consumers may
    /// have forgotten them already and would apply them again.
    pub older_than_retention: Vec<Uuid>,
    /// Dead letters kept because an event with the same id is in the outbox
    /// already (enqueued again, or replayed before): replaying would lose
    /// one of the two.
    pub conflicts: Vec<Uuid>,
    /// Dead letters kept because the table refuses them (a name over 255
    /// bytes, migration 4): they can never be published as they are.
    pub unpublishable: Vec<Uuid>,
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
/// it. Events older than `retention` are replayed but reported. A dead
/// letter whose id is in the outbox already, or that the table refuses,
/// stays where it is and is reported ([`Replayed::conflicts`],
/// [`Replayed::unpublishable`]): a dead letter is deleted only once its
/// event is back in the outbox.
pub async fn replay_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    retention: std::time::Duration,
) -> Result<Replayed> {
    let s = schema.quoted();
    let mut tx = pool.begin().await?;
    // Each selected dead letter, locked: whether its id is in the outbox,
    // and whether the outbox's CHECKs would take it.
    let selected: Vec<(Uuid, bool, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT d.id,
                EXISTS (SELECT 1 FROM {s}.outbox o WHERE o.id = d.id),
                octet_length(d.event_type) <= 255
                AND (d.exchange IS NULL OR octet_length(d.exchange) <= 255)
                AND octet_length(coalesce(d.routing_key, d.aggregate_type || '.' || d.event_type)) <= 255
                AND {s}.outbox_header_names_fit(d.headers)
         FROM {s}.outbox_dead_letters d
         WHERE $1::uuid[] IS NULL OR d.id = ANY($1)
         ORDER BY d.id
         FOR UPDATE OF d"
    )))
    .bind(selection.ids())
    .fetch_all(&mut *tx)
    .await?;
    let wanted: Vec<Uuid> = selected
        .iter()
        .filter(|(_, in_outbox, ok)| !in_outbox && *ok)
        .map(|(id, ..)| *id)
        .collect();
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "INSERT INTO {s}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange,
                                 routing_key, created_at, available_at, attempts, last_error, error_history,
                                 aggregate_seq)
         SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                created_at, now(), 0, NULL,
                error_history || jsonb_build_array(jsonb_build_object('at', now(), 'error', 'replayed from dead letters')),
                aggregate_seq
         FROM {s}.outbox_dead_letters WHERE id = ANY($1)
         ON CONFLICT (id) DO NOTHING
         RETURNING id, created_at < now() - $2 * interval '1 millisecond'"
    )))
    .bind(&wanted)
    .bind(retention.as_millis() as i64)
    .fetch_all(&mut *tx)
    .await?;
    let replayed: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    // Only what reached the outbox leaves the dead letters (an id a
    // producer inserted meanwhile is a conflict too).
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {s}.outbox_dead_letters WHERE id = ANY($1)"
    )))
    .bind(&replayed)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
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
    let replayed_set: std::collections::HashSet<Uuid> = replayed.iter().copied().collect();
    let unpublishable: Vec<Uuid> = selected
        .iter()
        .filter(|(_, in_outbox, ok)| !in_outbox && !ok)
        .map(|(id, ..)| *id)
        .collect();
    let conflicts: Vec<Uuid> = selected
        .iter()
        .filter(|(id, _, ok)| *ok && !replayed_set.contains(id))
        .map(|(id, ..)| *id)
        .collect();
    Ok(Replayed {
        replayed: replayed.len() as u64,
        older_than_retention: older,
        conflicts,
        unpublishable,
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
