//! Operator views and actions: backlog status, blocked aggregates, partition
//! leases and the dead-letter table.

use chrono::{DateTime, Utc};
use outbox::Ident;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::error::Result;
use crate::queries::Queries;

/// The outbox at a glance (`outbox-relay status`).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
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
    /// How many ordered aggregates are blocked by a failing event.
    pub blocked_aggregates: i64,
    /// The oldest of them, at most 20 (see [`blocked_aggregates`]): their
    /// later events wait for the failing one.
    pub blocked: Vec<BlockedAggregate>,
    /// Relays holding partition leases of ordered events, and how many.
    pub relays: Vec<RelayLeases>,
    /// Partitions no live relay holds (their ordered events wait for one).
    pub unleased_partitions: i64,
}

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
    /// Later events of the aggregate waiting behind it.
    pub waiting: i64,
}

/// A relay and the partitions it leases.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct RelayLeases {
    /// The relay's name (`--name`).
    pub name: String,
    /// Partitions it holds (of 64).
    pub partitions: i64,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_s: f64,
    /// The broker node it publishes to (`host:port`), as it last recorded.
    pub broker: Option<String>,
}

/// An event being retried.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
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
    let blocked = blocked_aggregates(pool, schema, 20).await?;
    let blocked_count = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.outbox o {}",
        blocked_heads(&s)
    )))
    .fetch_one(pool)
    .await?;
    let relays = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT r.name, count(l.partition) AS partitions,
                extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age_s,
                r.broker
         FROM {s}.outbox_relays r
         LEFT JOIN {s}.outbox_leases l ON l.owner = r.id AND l.expires_at > now()
         GROUP BY r.id, r.name, r.heartbeat_at, r.broker ORDER BY r.name"
    )))
    .fetch_all(pool)
    .await?;
    let unleased_partitions = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.outbox_leases WHERE owner IS NULL OR expires_at <= now()"
    )))
    .fetch_one(pool)
    .await?;
    Ok(Status {
        backlog,
        due,
        oldest_pending_age_s: oldest,
        retrying,
        dead_letters,
        failing,
        blocked_aggregates: blocked_count,
        blocked,
        relays,
        unleased_partitions,
    })
}

/// The relay's gauges, cheap on any size of outbox: no statement scans
/// the outbox or the dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Gauges {
    /// Events in the outbox: exact up to [`EXACT_COUNT_UP_TO`] rows, the
    /// planner's estimate (`pg_class.reltuples`) above.
    pub backlog: i64,
    /// Seconds the most overdue unordered event has been due (0 when none
    /// is due), from the claim index.
    pub oldest_due_age_s: f64,
    /// Dead letters, exact or estimated like `backlog`.
    pub dead_letters: i64,
    /// Ordered aggregates whose head has failed, from the partial index of
    /// failed ordered events (migration 7).
    pub blocked_aggregates: i64,
}

/// Up to this many rows (by the planner's estimate) a count is exact.
pub const EXACT_COUNT_UP_TO: i64 = 100_000;

/// Reads the [`Gauges`] of `schema`.
pub async fn gauges(pool: &PgPool, schema: &Ident) -> Result<Gauges> {
    let s = schema.quoted();
    let count = |table: &str| {
        format!(
            "(SELECT CASE WHEN c.reltuples < 0 OR c.reltuples <= {EXACT_COUNT_UP_TO}
                     THEN (SELECT count(*) FROM {s}.{table}) ELSE c.reltuples::bigint END
              FROM pg_class c WHERE c.oid = to_regclass('{s}.{table}'))"
        )
    };
    let (backlog, oldest_due_age_s, dead_letters, blocked_aggregates): (i64, f64, i64, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {backlog},
                    coalesce(greatest(0, extract(epoch FROM now() - (
                        SELECT available_at FROM {s}.outbox WHERE aggregate_seq IS NULL
                        ORDER BY available_at, id LIMIT 1)))::float8, 0),
                    {dead},
                    (SELECT count(*) FROM {s}.outbox o {blocked})",
            backlog = count("outbox"),
            dead = count("outbox_dead_letters"),
            blocked = blocked_heads(&s),
        )))
        .fetch_one(pool)
        .await?;
    Ok(Gauges {
        backlog,
        oldest_due_age_s,
        dead_letters,
        blocked_aggregates,
    })
}

/// The condition on `outbox o` that makes `o` a blocked aggregate's head:
/// ordered, failed at least once, nothing earlier of its aggregate left.
fn blocked_heads(s: &str) -> String {
    format!(
        "WHERE o.aggregate_seq IS NOT NULL AND o.attempts > 0
           AND NOT EXISTS (SELECT 1 FROM {s}.outbox e
                           WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id
                             AND e.aggregate_seq < o.aggregate_seq)"
    )
}

/// Ordered aggregates whose head event has failed at least once, oldest
/// first: their later events wait until it is delivered, dead-lettered or
/// skipped.
pub async fn blocked_aggregates(
    pool: &PgPool,
    schema: &Ident,
    limit: i64,
) -> Result<Vec<BlockedAggregate>> {
    let s = schema.quoted();
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT o.aggregate_type, o.aggregate_id, o.id AS event_id, o.aggregate_seq, o.attempts, o.last_error,
                o.available_at AS next_attempt_at,
                (SELECT count(*) FROM {s}.outbox w
                 WHERE w.aggregate_type = o.aggregate_type AND w.aggregate_id = o.aggregate_id
                   AND w.aggregate_seq > o.aggregate_seq) AS waiting
         FROM {s}.outbox o {}
         ORDER BY o.created_at LIMIT $1",
        blocked_heads(&s)
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Moves the given events from the outbox to the dead-letter table with
/// `reason`, so the aggregates they block move on (consumers see the gap
/// in the sequence). Waits for any batch in flight on their partitions
/// and keeps relays off them until done. Returns how many were moved; a
/// moved event can be replayed like any dead letter.
pub async fn skip_events(pool: &PgPool, schema: &Ident, ids: &[Uuid], reason: &str) -> Result<u64> {
    let s = schema.quoted();
    let mut tx = pool.begin().await?;
    // The partitions' lease rows, exclusively: relays publish a partition
    // only while holding its row FOR KEY SHARE.
    sqlx::query(AssertSqlSafe(format!(
        "SELECT partition FROM {s}.outbox_leases
         WHERE partition IN (SELECT {s}.outbox_partition(aggregate_type, aggregate_id)
                             FROM {s}.outbox WHERE id = ANY($1))
         ORDER BY partition FOR UPDATE"
    )))
    .bind(ids)
    .execute(&mut *tx)
    .await?;
    let errors = vec![format!("skipped by an operator: {reason}"); ids.len()];
    let moved = sqlx::query(Queries::new(schema).dead_letter)
        .bind(ids)
        .bind(&errors)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    tx.commit().await?;
    Ok(moved)
}

/// Makes the given failed events due now instead of at their next
/// backoff. Returns how many were rescheduled.
pub async fn retry_now(pool: &PgPool, schema: &Ident, ids: &[Uuid]) -> Result<u64> {
    Ok(sqlx::query(AssertSqlSafe(format!(
        "UPDATE {}.outbox SET available_at = now() WHERE id = ANY($1) AND available_at > now()",
        schema.quoted()
    )))
    .bind(ids)
    .execute(pool)
    .await?
    .rows_affected())
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
