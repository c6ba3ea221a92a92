//! One pass of the handlers over a batch: the per-event handler in
//! delivery order (in sequence, when ordered), with or without a savepoint
//! per event, or the batch handler once; each a verdict per event.

use std::collections::HashSet;

use futures_util::FutureExt as _;
use sqlx::PgConnection;
use tracing::Instrument as _;

use super::{Batch, Failure, Verdict, bounded, in_failed_transaction};
use crate::event::Event;
use crate::handler::{BatchOutcome, Handlers, Outcome};
use crate::sequence::{Deferral, Sequencer, Turn};

/// How one pass of the handlers ended.
pub(super) enum Ran {
    /// Every event handled (or, isolated, every outcome recorded).
    Done,
    /// A pass without savepoints hit a failure: roll back and rerun
    /// isolated, with the failing event's outcome when it is known.
    Again(Option<(usize, Outcome)>),
    /// The batch handler failed as a whole: roll back, every fresh event
    /// has its (failing) verdict.
    AllFailed,
}

/// Runs the handlers of one pass over `passes` (per-event handlers) or
/// `to_handle` (a batch handler), recording verdicts.
pub(super) async fn run_handlers(
    tx: &mut PgConnection,
    handlers: &Handlers,
    batch: &Batch<'_>,
    fresh: &HashSet<&str>,
    (to_handle, passes): (&[usize], &[usize]),
    pass: Pass<'_>,
    verdicts: &mut [Verdict],
) -> Result<Ran, Failure> {
    Ok(match handlers {
        Handlers::PerEvent(h) => {
            match run_each(tx, h.as_ref(), batch, fresh, passes, pass, verdicts).await? {
                Pass1::Done => Ran::Done,
                Pass1::Failed(failure) => Ran::Again(failure),
            }
        }
        Handlers::Batch(h) => {
            let timeout = batch.handler_timeout;
            if run_batch(tx, h.as_ref(), batch.events, to_handle, timeout, verdicts).await? {
                Ran::AllFailed
            } else {
                Ran::Done
            }
        }
    })
}

pub(super) struct Pass<'s> {
    /// Savepoint per event.
    pub(super) isolated: bool,
    /// An event whose (failing) outcome is already decided.
    pub(super) known: Option<(usize, Outcome)>,
    /// Sequencing on: the sequence state of the batch's aggregates.
    pub(super) order: Option<&'s mut Sequencer>,
}

/// How a pass of [`run_each`] ended.
enum Pass1 {
    /// Every event handled (or, isolated, every outcome recorded).
    Done,
    /// A non-isolated pass hit a failure: rerun isolated. The failing
    /// event's outcome is kept when it is the handler's own decision, not
    /// the echo of an earlier handler's swallowed database error.
    Failed(Option<(usize, Outcome)>),
}

/// Runs the per-event handler over `passes` in delivery order, once per
/// `fresh` id (the first copy of it that runs). With ordering, only for
/// the events next in their aggregate's sequence; a copy of an id already
/// applied moves its aggregate past its number without running.
/// A non-isolated pass stops at the first failure and returns it: the
/// batch must be rerun isolated.
async fn run_each(
    tx: &mut PgConnection,
    h: &dyn crate::handler::DynHandler,
    batch: &Batch<'_>,
    fresh: &HashSet<&str>,
    passes: &[usize],
    mut pass: Pass<'_>,
    verdicts: &mut [Verdict],
) -> Result<Pass1, Failure> {
    // Ids whose handler ran in this pass.
    let mut ran: HashSet<&str> = HashSet::new();
    for &i in passes {
        let id = batch.events[i].id();
        let position = batch.position(i);
        let handle = fresh.contains(id) && !ran.contains(id);
        if let (Some(order), Some(p)) = (pass.order.as_deref(), position) {
            let not_applied = match order.turn(p) {
                // A copy of an event applied before: its number is passed
                // over, without running the handler.
                Turn::Apply if !handle => {
                    if let Some(order) = pass.order.as_deref_mut() {
                        order.record(p, true);
                    }
                    Some(Verdict::Duplicate)
                }
                Turn::Stale { .. } if !handle => Some(Verdict::Duplicate),
                Turn::Apply => None,
                Turn::Stale { last } => Some(Verdict::Stale { seq: p.seq, last }),
                Turn::Gap { expected } => Some(Verdict::Deferred(Deferral {
                    expected,
                    got: p.seq,
                    held_back: false,
                })),
                Turn::HeldBack { expected } => Some(Verdict::Deferred(Deferral {
                    expected,
                    got: p.seq,
                    held_back: true,
                })),
            };
            if let Some(v) = not_applied {
                verdicts[i] = v;
                continue;
            }
        }
        if !handle {
            continue;
        }
        ran.insert(id);
        let outcome = match &pass.known {
            Some((k, o)) if *k == i => o.clone(),
            _ => match run_one(tx, h, batch, i, pass.isolated).await? {
                Some(outcome) => outcome,
                None => return Ok(Pass1::Failed(None)),
            },
        };
        if !pass.isolated && !outcome.is_ack() {
            return Ok(Pass1::Failed(Some((i, outcome))));
        }
        if let (Some(order), Some(p)) = (pass.order.as_deref_mut(), position) {
            order.record(p, outcome.is_ack());
        }
        verdicts[i] = Verdict::Handled(outcome);
    }
    Ok(Pass1::Done)
}

/// Runs the handler for event `i`; isolated, inside its own savepoint.
/// `None`: a non-isolated pass found the transaction aborted by an
/// earlier handler, so this event's failure is only that error's echo
/// and it must be asked again when isolated. A handler's
/// [`Outcome::Conflict`] is the whole transaction's failure: the locks
/// the batch took before this event are part of the cycle.
async fn run_one(
    tx: &mut PgConnection,
    h: &dyn crate::handler::DynHandler,
    batch: &Batch<'_>,
    i: usize,
    isolated: bool,
) -> Result<Option<Outcome>, Failure> {
    // The statement after a handler call may first wait for what the
    // call left running to end (by `statement_timeout`, the handler
    // timeout).
    let after_handler = batch.statement_bound + batch.handler_timeout;
    if isolated {
        let savepoint = sqlx::raw_sql("SAVEPOINT outbox_event").execute(&mut *tx);
        bounded(batch.statement_bound, savepoint).await?;
    }
    let outcome = guarded(
        batch.handler_timeout,
        h.handle_dyn(&mut *tx, &batch.events[i]),
    )
    .instrument(batch.spans[i].clone())
    .await;
    if let Some(c) = outcome.conflict() {
        return Err(Failure::Conflict(c));
    }
    if !isolated {
        if !outcome.is_ack() {
            match bounded(after_handler, sqlx::raw_sql("SELECT 1").execute(&mut *tx)).await {
                Ok(_) => {}
                Err(e) if in_failed_transaction(&e) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Some(outcome));
    }
    if !outcome.is_ack() {
        bounded(after_handler, rollback_to(tx, UNDO_EVENT)).await?;
        return Ok(Some(outcome));
    }
    let release = sqlx::raw_sql("RELEASE SAVEPOINT outbox_event").execute(&mut *tx);
    match bounded(after_handler, release).await {
        Ok(_) => Ok(Some(outcome)),
        Err(e) if in_failed_transaction(&e) => {
            bounded(batch.statement_bound, rollback_to(tx, UNDO_EVENT)).await?;
            Ok(Some(Outcome::retry(
                "handler returned Ack but one of its statements failed",
            )))
        }
        Err(e) => Err(e.into()),
    }
}

/// Runs the batch handler over the fresh events; returns true when every
/// one of them failed (the caller rolls the transaction back). No savepoint:
/// a batch handler that fails some events of an `Each` outcome must not
/// have applied their effects (it is set-based: it knows which it applied).
/// An [`Outcome::Conflict`] for any event fails the whole transaction.
async fn run_batch(
    tx: &mut PgConnection,
    h: &dyn crate::handler::DynBatchHandler,
    events: &[Event],
    to_handle: &[usize],
    timeout: std::time::Duration,
    verdicts: &mut [Verdict],
) -> Result<bool, Failure> {
    if to_handle.is_empty() {
        return Ok(false);
    }
    // `to_handle` is increasing: as long as `events`, it is all of them, in
    // order, and the handler sees them without a copy (the common batch:
    // no duplicates, nothing already decided).
    let copies: Vec<Event>;
    let fresh: &[Event] = if to_handle.len() == events.len() {
        events
    } else {
        copies = to_handle.iter().map(|&i| events[i].clone()).collect();
        &copies
    };
    let call = std::panic::AssertUnwindSafe(h.handle_batch_dyn(&mut *tx, fresh)).catch_unwind();
    let outcome = match tokio::time::timeout(timeout, call).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => BatchOutcome::All(Outcome::retry("batch handler panicked")),
        Err(_) => BatchOutcome::All(Outcome::retry(format!(
            "batch handler did not return within its timeout ({timeout:?})"
        ))),
    };
    let outcomes = match outcome {
        BatchOutcome::All(o) => vec![o; to_handle.len()],
        BatchOutcome::Each(v) if v.len() == to_handle.len() => v,
        BatchOutcome::Each(v) => {
            let why = format!(
                "batch handler returned {} outcomes for {} events",
                v.len(),
                to_handle.len()
            );
            tracing::error!("{why}");
            vec![Outcome::Retry(why); to_handle.len()]
        }
    };
    if let Some(c) = outcomes.iter().find_map(Outcome::conflict) {
        return Err(Failure::Conflict(c));
    }
    let all_failed = outcomes.iter().all(|o| !o.is_ack());
    for (&i, o) in to_handle.iter().zip(outcomes) {
        verdicts[i] = Verdict::Handled(o);
    }
    Ok(all_failed)
}

/// A panicking handler is a retry, not a dead consumer; so is one that
/// does not return within `timeout` (a statement it left running ends by
/// the transaction's `statement_timeout` before the next one starts).
async fn guarded(timeout: std::time::Duration, f: impl Future<Output = Outcome>) -> Outcome {
    match tokio::time::timeout(timeout, std::panic::AssertUnwindSafe(f).catch_unwind()).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => Outcome::retry("handler panicked"),
        Err(_) => Outcome::retry(format!(
            "handler did not return within its timeout ({timeout:?})"
        )),
    }
}

const UNDO_EVENT: &str = "ROLLBACK TO SAVEPOINT outbox_event; RELEASE SAVEPOINT outbox_event";

async fn rollback_to(tx: &mut PgConnection, undo: &'static str) -> sqlx::Result<()> {
    sqlx::raw_sql(undo).execute(tx).await?;
    Ok(())
}
