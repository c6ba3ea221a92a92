//! Recording what the broker said, in the claim's transaction.

use std::collections::HashSet;
use std::time::Duration;

use crate::config::RelayConfig;
use crate::error::Result;
use crate::message::OutboxEvent;
use crate::publish::Receipt;
use outbox::Ident;
use outbox_core::backoff::jittered;
use sqlx::{PgConnection, PgPool, SqlStr};
use uuid::Uuid;

/// The settle stage's statements for one schema (`settle/*.sql`).
#[derive(Debug, Clone)]
struct Statements {
    delete: SqlStr,
    archive: SqlStr,
    reschedule: SqlStr,
    dead_letter: SqlStr,
}

impl Statements {
    fn new(schema: &Ident) -> Self {
        use crate::sql::render;
        Self {
            delete: render(include_str!("settle/delete.sql"), schema),
            archive: render(include_str!("settle/archive.sql"), schema),
            reschedule: render(include_str!("settle/reschedule.sql"), schema),
            dead_letter: render(include_str!("settle/dead_letter.sql"), schema),
        }
    }
}

/// Moves the events `ids` from the outbox to its dead-letter table, each
/// with its final error (`errors`, one per id, in order) added to its
/// history, inside the caller's transaction; the relays' own move, for an
/// operator's skip. Events no longer in the outbox are left out. Returns
/// how many were moved.
pub async fn dead_letter_events(
    conn: &mut PgConnection,
    schema: &Ident,
    ids: &[Uuid],
    errors: &[String],
) -> sqlx::Result<u64> {
    let sql = crate::sql::render(include_str!("settle/dead_letter.sql"), schema);
    Ok(sqlx::query(sql)
        .bind(ids)
        .bind(errors)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Counts of one settled batch.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct Settled {
    /// Delivered and removed (or archived).
    pub delivered: usize,
    /// Failed and rescheduled with backoff.
    pub retried: usize,
    /// Moved to the dead-letter table.
    pub dead_lettered: usize,
    /// Ordered events left untouched because an earlier event of their
    /// aggregate failed in the same batch: they go again after it.
    pub held_back: usize,
    /// Left untouched because the batch's publish deadline passed before
    /// they were sent, or (the log's reader) queued behind their
    /// aggregate's events in the table (no attempt counted).
    pub not_sent: usize,
}

/// The settle stage of one relay (the table's workers and the log's
/// reader): its statements and the rules it settles by.
#[derive(Debug, Clone)]
pub(crate) struct Settle {
    sql: Statements,
    rules: Rules,
}

/// What [`Settle`] takes of the relay's configuration.
#[derive(Debug, Clone, Copy)]
struct Rules {
    /// Delivered events are archived, not deleted (`--archive`).
    archive: bool,
    /// An unordered event failing this many times is dead-lettered.
    max_attempts: i32,
    /// The backoff's first delay and its cap.
    retry_base: Duration,
    retry_max: Duration,
}

impl Settle {
    /// The settle stage for `schema`, by `config`'s rules.
    pub(crate) fn new(schema: &Ident, config: &RelayConfig) -> Self {
        Self {
            sql: Statements::new(schema),
            rules: Rules {
                archive: config.archive,
                max_attempts: config.max_attempts,
                retry_base: config.retry_base,
                retry_max: config.retry_max,
            },
        }
    }

    /// Moves the event `id` to the dead letters with `error`: quarantine's
    /// set-aside of an unordered event a worker panicked on.
    pub(crate) async fn dead_letter_one(&self, pool: &PgPool, id: Uuid, error: &str) -> Result<()> {
        sqlx::query(self.sql.dead_letter.clone())
            .bind([id])
            .bind([error])
            .execute(pool)
            .await?;
        Ok(())
    }

    /// Records a failed attempt of the event `id` with `error`, due again
    /// in `delay_ms`: quarantine's set-aside of an ordered event.
    pub(crate) async fn reschedule_one(
        &self,
        pool: &PgPool,
        id: Uuid,
        delay_ms: i64,
        error: &str,
    ) -> Result<()> {
        sqlx::query(self.sql.reschedule.clone())
            .bind([id])
            .bind([delay_ms])
            .bind([error])
            .execute(pool)
            .await?;
        Ok(())
    }

    /// Deletes (or archives) delivered events, reschedules failed ones with
    /// backoff and dead-letters those out of attempts. At most three
    /// statements per batch, whatever its size.
    ///
    /// Ordered events (in the batch in aggregate order): the first failure
    /// of an aggregate is retried with backoff, whatever its attempts
    /// (never dead-lettered here: only an operator's skip moves past it);
    /// the aggregate's later events in the batch are left as they are,
    /// even if the broker took them: they go again after it. Claims only
    /// ever start an aggregate at its head, so nothing overtakes the
    /// failed event.
    pub(crate) async fn settle(
        &self,
        conn: &mut PgConnection,
        events: &[OutboxEvent],
        outcomes: &[Receipt],
    ) -> Result<Settled> {
        settle(conn, &self.sql, self.rules, events, outcomes).await
    }
}

async fn settle(
    conn: &mut PgConnection,
    sql: &Statements,
    config: Rules,
    events: &[OutboxEvent],
    outcomes: &[Receipt],
) -> Result<Settled> {
    let plan = plan(config, events, outcomes);
    if !plan.delivered.is_empty() {
        let q = if config.archive {
            &sql.archive
        } else {
            &sql.delete
        };
        sqlx::query(q.clone())
            .bind(&plan.delivered)
            .execute(&mut *conn)
            .await?;
    }
    if !plan.retry_ids.is_empty() {
        sqlx::query(sql.reschedule.clone())
            .bind(&plan.retry_ids)
            .bind(&plan.retry_delays)
            .bind(&plan.retry_errors)
            .execute(&mut *conn)
            .await?;
    }
    if !plan.dead_ids.is_empty() {
        sqlx::query(sql.dead_letter.clone())
            .bind(&plan.dead_ids)
            .bind(&plan.dead_errors)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Settled {
        delivered: plan.delivered.len(),
        retried: plan.retry_ids.len(),
        dead_lettered: plan.dead_ids.len(),
        held_back: plan.held_back,
        not_sent: plan.not_sent,
    })
}

/// What a batch's settle writes: the three statements' arrays.
#[derive(Debug, Default)]
struct Plan {
    delivered: Vec<Uuid>,
    retry_ids: Vec<Uuid>,
    retry_delays: Vec<i64>,
    retry_errors: Vec<String>,
    dead_ids: Vec<Uuid>,
    dead_errors: Vec<String>,
    held_back: usize,
    not_sent: usize,
}

/// Sorts a batch's events by their receipts (the rules of [`settle`]).
fn plan(config: Rules, events: &[OutboxEvent], outcomes: &[Receipt]) -> Plan {
    let mut plan = Plan::default();
    let mut failed_aggregates = HashSet::new();
    for (e, o) in events.iter().zip(outcomes) {
        let aggregate = e
            .aggregate_seq
            .map(|_| (e.aggregate_type.as_str(), e.aggregate_id.as_str()));
        if let Some((t, a)) = aggregate
            && failed_aggregates.contains(&(t, a))
        {
            plan.held_back += 1;
            continue;
        }
        if matches!(o, Receipt::NotSent | Receipt::Queued) {
            plan.not_sent += 1;
            if let Some((t, a)) = aggregate {
                failed_aggregates.insert((t, a));
            }
            continue;
        }
        let Some(error) = o.error() else {
            plan.delivered.push(e.id);
            continue;
        };
        let attempt = e.attempts.saturating_add(1);
        // An ordered event is never dead-lettered by the relay: that would
        // leave a hole its consumers wait on. It blocks its aggregate
        // (`outbox-relay blocked`) until delivered or skipped.
        if aggregate.is_none() && (o.is_permanent() || attempt >= config.max_attempts) {
            plan.dead_ids.push(e.id);
            plan.dead_errors.push(error);
        } else {
            let delay =
                jittered(config.retry_base, config.retry_max, attempt as u32).as_millis() as i64;
            plan.retry_ids.push(e.id);
            plan.retry_delays.push(delay);
            plan.retry_errors.push(error);
        }
        if let Some((t, a)) = aggregate {
            failed_aggregates.insert((t, a));
        }
    }
    plan
}
