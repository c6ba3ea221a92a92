//! What `outbox-relay status` and the relay's gauges show: the backlog,
//! retries, dead letters, blocked aggregates and partition leases.

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::{Template, render};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::Result;
use super::blocked::{BlockedAggregate, blocked_aggregates, blocked_heads};
use super::estimate::estimated_rows;
use super::failures::{Failures, failures};

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
    /// The write-ahead-log capture's slot, when it is set up: who reads
    /// it and how far behind.
    pub wal: Option<crate::admin::wal::WalSlot>,
    /// Dead letters by error class, event type and exchange: the
    /// `STATUS_TOP_GROUPS` (5) largest groups of each.
    pub failures: Failures,
    /// What holds the xmin horizon back, and the outbox's dead rows.
    pub horizon: crate::admin::Horizon,
}

/// How many groups of each breakdown [`Status::failures`] names.
pub(crate) const STATUS_TOP_GROUPS: i64 = 5;

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

/// Reads the outbox status of `schema`.
pub async fn status(pool: &PgPool, schema: &Ident) -> Result<Status> {
    let (backlog, due, oldest, retrying): (i64, i64, Option<f64>, i64) =
        sqlx::query_as(render(include_str!("status/backlog.sql"), schema))
            .fetch_one(pool)
            .await?;
    let dead_letters: i64 = sqlx::query_scalar(render(
        "SELECT count(*) FROM {schema}.outbox_dead_letters",
        schema,
    ))
    .fetch_one(pool)
    .await?;
    let failing = sqlx::query_as(render(include_str!("status/failing.sql"), schema))
        .fetch_all(pool)
        .await?;
    let blocked = blocked_aggregates(pool, schema, 20).await?;
    let blocked_count = sqlx::query_scalar(
        Template::new(
            "SELECT count(*) FROM {schema}.outbox o {blocked_heads}",
            schema,
        )
        .with("blocked_heads", blocked_heads(schema))
        .render(),
    )
    .fetch_one(pool)
    .await?;
    let (relays, unleased_partitions) = relays(pool, schema).await?;
    let wal = crate::admin::wal::wal_slot(pool, schema).await?;
    let failures = failures(pool, schema, STATUS_TOP_GROUPS).await?;
    let horizon = crate::admin::horizon(pool, schema).await?;
    Ok(Status {
        horizon,
        wal,
        failures,
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

/// The relays in `outbox_relays` with the partitions each leases, and how
/// many partitions no live relay holds. Small tables: cheap at any backlog.
pub async fn relays(pool: &PgPool, schema: &Ident) -> Result<(Vec<RelayLeases>, i64)> {
    let relays = sqlx::query_as(render(include_str!("status/relays.sql"), schema))
        .fetch_all(pool)
        .await?;
    let unleased = sqlx::query_scalar(render(
        "SELECT count(*) FROM {schema}.outbox_leases WHERE owner IS NULL OR expires_at <= now()",
        schema,
    ))
    .fetch_one(pool)
    .await?;
    Ok((relays, unleased))
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
    // A table's rows: counted up to EXACT_COUNT_UP_TO, estimated above.
    let count = |table: &'static str| {
        Template::new(include_str!("status/gauge_count.sql"), schema)
            .with("table", table)
            .with("exact_count_up_to", EXACT_COUNT_UP_TO.to_string())
            .with("estimated_rows", estimated_rows(schema, table))
            .text()
    };
    let sql = Template::new(include_str!("status/gauges.sql"), schema)
        .with("backlog", count("outbox"))
        .with("dead_letters", count("outbox_dead_letters"))
        .with("blocked_heads", blocked_heads(schema))
        .render();
    let (backlog, oldest_due_age_s, dead_letters, blocked_aggregates): (i64, f64, i64, i64) =
        sqlx::query_as(sql).fetch_one(pool).await?;
    Ok(Gauges {
        backlog,
        oldest_due_age_s,
        dead_letters,
        blocked_aggregates,
    })
}
