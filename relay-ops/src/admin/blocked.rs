//! Blocked aggregates (ordered events): list them, retry their heads now,
//! or skip a head for good (`outbox-relay blocked`).

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::{Template, render};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::Result;

/// An ordered aggregate held up by its failing head event.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct BlockedAggregate {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// The failing event (skip it with `outbox-relay blocked skip <id>`).
    pub event_id: Uuid,
    /// Its sequence number.
    pub aggregate_seq: i64,
    /// Failed attempts so far.
    pub attempts: i32,
    /// Why it failed last.
    pub last_error: Option<String>,
    /// When it is tried again.
    pub next_attempt_at: DateTime<Utc>,
    /// Later events of the aggregate waiting behind it, counted up to
    /// [`WAITING_COUNTED_UP_TO`] (a larger queue shows as that).
    pub waiting: i64,
}

/// How far [`BlockedAggregate::waiting`] counts: an aggregate with a
/// million events queued behind its head costs no more than this to list.
pub const WAITING_COUNTED_UP_TO: i64 = 10_000;

/// The `WHERE` clause on `outbox o` that makes `o` a blocked aggregate's
/// head, for `schema`: the value of a template's `{blocked_heads}`. Ordered,
/// failed at least once (the partial index of migration 7), nothing
/// earlier of its aggregate left. The "nothing earlier" is a correlated
/// probe with `LIMIT 1`, not `NOT EXISTS`: on a table never analysed the
/// planner took the failed events for a third of the outbox and turned
/// `NOT EXISTS` into a hash anti-join over all of it (130-180 ms on
/// 2,000,000 rows); a probe per failed head stays one index descent.
pub(super) fn blocked_heads(schema: &Ident) -> String {
    Template::new(include_str!("blocked/heads.sql"), schema).text()
}

/// Ordered aggregates whose head event has failed at least once, oldest
/// first: their later events wait until it is delivered, dead-lettered or
/// skipped.
pub async fn blocked_aggregates(
    pool: &PgPool,
    schema: &Ident,
    limit: i64,
) -> Result<Vec<BlockedAggregate>> {
    let sql = Template::new(include_str!("blocked/aggregates.sql"), schema)
        .with("waiting_counted_up_to", WAITING_COUNTED_UP_TO.to_string())
        .with("blocked_heads", blocked_heads(schema))
        .render();
    Ok(sqlx::query_as(sql).bind(limit).fetch_all(pool).await?)
}

/// An event waiting behind a blocked aggregate's failing head.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct WaitingEvent {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event id.
    pub id: Uuid,
    /// Event type.
    pub event_type: String,
    /// Its sequence number.
    pub aggregate_seq: i64,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// The first `per_aggregate` events waiting behind the head of each of
/// the given aggregates (`(aggregate_type, aggregate_id)`), in sequence
/// order: one index descent per aggregate.
pub async fn waiting_events(
    pool: &PgPool,
    schema: &Ident,
    aggregates: &[(String, String)],
    per_aggregate: i64,
) -> Result<Vec<WaitingEvent>> {
    let (types, ids): (Vec<String>, Vec<String>) = aggregates.iter().cloned().unzip();
    Ok(
        sqlx::query_as(render(include_str!("blocked/waiting.sql"), schema))
            .bind(&types)
            .bind(&ids)
            .bind(per_aggregate)
            .fetch_all(pool)
            .await?,
    )
}

/// The longest skip reason kept, in characters (the rest is cut).
pub(crate) const REASON_MAX_CHARS: usize = 1_000;

/// Moves the given events from the outbox to the dead-letter table with
/// `reason` (its first `REASON_MAX_CHARS`, 1,000, characters), so the aggregates
/// they block move on (consumers see the gap in the sequence). Waits for
/// any batch in flight on their partitions and keeps relays off them until
/// done. Returns how many were moved; a moved event can be replayed like
/// any dead letter.
pub async fn skip_events(pool: &PgPool, schema: &Ident, ids: &[Uuid], reason: &str) -> Result<u64> {
    let reason: String = reason.chars().take(REASON_MAX_CHARS).collect();
    let mut tx = pool.begin().await?;
    // The partitions' lease rows, exclusively: relays publish a partition
    // only while holding its row FOR KEY SHARE.
    sqlx::query(render(include_str!("blocked/lock_partitions.sql"), schema))
        .bind(ids)
        .execute(&mut *tx)
        .await?;
    let errors = vec![format!("skipped by an operator: {reason}"); ids.len()];
    let moved = outbox_relay::dead_letter_events(&mut *tx, schema, ids, &errors).await?;
    // Each aggregate's next event becomes its head; it may have been due
    // long before, where the relays' walks passed it while the skipped one
    // blocked it: its due time is written from the clock, so the walks
    // find it (relay/src/claim/ordered.rs). One not due yet keeps its
    // time.
    sqlx::query(render(include_str!("blocked/next_heads_due.sql"), schema))
        .bind(ids)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(moved)
}

/// Makes the given failed events due now instead of at their next
/// backoff. Returns how many were rescheduled.
pub async fn retry_now(pool: &PgPool, schema: &Ident, ids: &[Uuid]) -> Result<u64> {
    let sql = render(
        "UPDATE {schema}.outbox SET available_at = clock_timestamp() \
         WHERE id = ANY($1) AND available_at > now()",
        schema,
    );
    Ok(sqlx::query(sql)
        .bind(ids)
        .execute(pool)
        .await?
        .rows_affected())
}
