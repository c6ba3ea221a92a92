//! One batch, one transaction: dedup every delivery in one statement, run
//! the handler for fresh events only, isolate each event's effect, commit.

use std::collections::HashSet;

use futures_util::FutureExt as _;
use sqlx::{PgConnection, PgPool};
use tracing::{Instrument as _, Span};

use crate::dedup::Inbox;
use crate::event::Event;
use crate::handler::{BatchOutcome, Handlers, Outcome};

/// What happened to one event of a committed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Already in the inbox (processed before, or earlier in this batch):
    /// ack without effect.
    Duplicate,
    /// Fresh; the handler decided.
    Handled(Outcome),
}

/// Processes `events` in one transaction and commits it. `Err` means
/// nothing committed; the caller retries the batch or lets it be
/// redelivered.
pub(crate) async fn process(
    pool: &PgPool,
    inbox: &Inbox,
    handlers: &Handlers,
    events: &[Event],
    spans: &[Span],
) -> sqlx::Result<Vec<Verdict>> {
    let mut keys: Vec<&str> = events.iter().map(|e| e.id()).collect();
    keys.sort_unstable();
    keys.dedup();
    // Per-event handlers first run without savepoints (one round trip less
    // per event); the first failure rolls back and reruns the batch with a
    // savepoint per event, so a failing event cannot undo the others.
    // The failure found by the first pass is kept, not asked again: each
    // handler decision about a failing event is made once.
    let isolated_only = matches!(handlers, Handlers::Batch(_));
    let mut known: Option<(usize, Outcome)> = None;
    for isolated in [isolated_only, true] {
        let mut tx = pool.begin().await?;
        let fresh = inbox.claim(&mut tx, &keys).await?;
        let fresh: HashSet<&str> = fresh.iter().map(String::as_str).collect();
        // Only the first delivery of a fresh key runs; later copies in the
        // same batch are duplicates.
        let mut first = HashSet::new();
        let runs: Vec<usize> = (0..events.len())
            .filter(|&i| fresh.contains(events[i].id()) && first.insert(events[i].id()))
            .collect();
        let mut verdicts = vec![Verdict::Duplicate; events.len()];
        let done = match handlers {
            Handlers::PerEvent(h) => {
                let pass = Pass {
                    isolated,
                    known: known.take(),
                };
                match run_each(
                    &mut tx,
                    h.as_ref(),
                    events,
                    spans,
                    &runs,
                    pass,
                    &mut verdicts,
                )
                .await?
                {
                    Pass1::Done => true,
                    Pass1::Failed(failure) => {
                        known = failure;
                        false
                    }
                }
            }
            Handlers::Batch(h) => {
                let all_failed = run_batch(&mut tx, h.as_ref(), events, &runs, &mut verdicts).await;
                if all_failed {
                    // Nothing to keep: the duplicates' inbox rows were
                    // committed before, the fresh ones must not be.
                    tx.rollback().await?;
                    return Ok(verdicts);
                }
                true
            }
        };
        if !done {
            tx.rollback().await?;
            continue;
        }
        let failed: Vec<&str> = runs
            .iter()
            .filter(|&&i| !matches!(verdicts[i], Verdict::Handled(Outcome::Ack)))
            .map(|&i| events[i].id())
            .collect();
        // Also the guard against a handler that returned Ack after one of
        // its statements failed: in an aborted transaction this statement
        // errors, where COMMIT would silently roll back and we would ack.
        match inbox.forget(&mut tx, &failed).await {
            Ok(()) => {}
            Err(e) if isolated_only && in_failed_transaction(&e) => {
                tx.rollback().await?;
                for &i in &runs {
                    verdicts[i] = Verdict::Handled(Outcome::retry(
                        "batch handler returned Ack but one of its statements failed",
                    ));
                }
                return Ok(verdicts);
            }
            // A handler said Ack but left the transaction aborted: redo
            // with savepoints, which pins it on that event.
            Err(e) if !isolated && in_failed_transaction(&e) => {
                tx.rollback().await?;
                continue;
            }
            Err(e) => return Err(e),
        }
        tx.commit().await?;
        return Ok(verdicts);
    }
    unreachable!("the isolated pass always returns")
}

struct Pass {
    /// Savepoint per event.
    isolated: bool,
    /// An event whose (failing) outcome is already decided.
    known: Option<(usize, Outcome)>,
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

/// Runs the per-event handler for each fresh event. A non-isolated pass
/// stops at the first failure and returns it: the batch must be rerun
/// isolated.
async fn run_each(
    tx: &mut PgConnection,
    h: &dyn crate::handler::DynHandler,
    events: &[Event],
    spans: &[Span],
    runs: &[usize],
    pass: Pass,
    verdicts: &mut [Verdict],
) -> sqlx::Result<Pass1> {
    for &i in runs {
        if let Some((k, o)) = &pass.known
            && *k == i
        {
            verdicts[i] = Verdict::Handled(o.clone());
            continue;
        }
        if pass.isolated {
            sqlx::raw_sql("SAVEPOINT outbox_event")
                .execute(&mut *tx)
                .await?;
        }
        let mut outcome = guarded(h.handle_dyn(&mut *tx, &events[i]))
            .instrument(spans[i].clone())
            .await;
        if !pass.isolated {
            if !outcome.is_ack() {
                // If an earlier handler returned Ack after one of its
                // statements failed, this failure is only the aborted
                // transaction's echo: ask this event again when isolated.
                let aborted = match sqlx::raw_sql("SELECT 1").execute(&mut *tx).await {
                    Ok(_) => false,
                    Err(e) if in_failed_transaction(&e) => true,
                    Err(e) => return Err(e),
                };
                return Ok(Pass1::Failed((!aborted).then_some((i, outcome))));
            }
        } else if outcome.is_ack() {
            match sqlx::raw_sql("RELEASE SAVEPOINT outbox_event")
                .execute(&mut *tx)
                .await
            {
                Ok(_) => {}
                Err(e) if in_failed_transaction(&e) => {
                    rollback_to(tx, UNDO_EVENT).await?;
                    outcome =
                        Outcome::retry("handler returned Ack but one of its statements failed");
                }
                Err(e) => return Err(e),
            }
        } else {
            rollback_to(tx, UNDO_EVENT).await?;
        }
        verdicts[i] = Verdict::Handled(outcome);
    }
    Ok(Pass1::Done)
}

/// Runs the batch handler over the fresh events; returns true when every
/// one of them failed (the caller rolls the transaction back). No savepoint:
/// a batch handler that fails some events of an `Each` outcome must not
/// have applied their effects (it is set-based: it knows which it applied).
async fn run_batch(
    tx: &mut PgConnection,
    h: &dyn crate::handler::DynBatchHandler,
    events: &[Event],
    runs: &[usize],
    verdicts: &mut [Verdict],
) -> bool {
    if runs.is_empty() {
        return false;
    }
    let fresh: Vec<Event> = runs.iter().map(|&i| events[i].clone()).collect();
    let outcome = std::panic::AssertUnwindSafe(h.handle_batch_dyn(&mut *tx, &fresh))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| BatchOutcome::All(Outcome::retry("batch handler panicked")));
    let outcomes = match outcome {
        BatchOutcome::All(o) => vec![o; runs.len()],
        BatchOutcome::Each(v) if v.len() == runs.len() => v,
        BatchOutcome::Each(v) => {
            let why = format!(
                "batch handler returned {} outcomes for {} events",
                v.len(),
                runs.len()
            );
            tracing::error!("{why}");
            vec![Outcome::Retry(why); runs.len()]
        }
    };
    let all_failed = outcomes.iter().all(|o| !o.is_ack());
    for (&i, o) in runs.iter().zip(outcomes) {
        verdicts[i] = Verdict::Handled(o);
    }
    all_failed
}

/// A panicking handler is a retry, not a dead consumer.
async fn guarded(f: impl Future<Output = Outcome>) -> Outcome {
    std::panic::AssertUnwindSafe(f)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Outcome::retry("handler panicked"))
}

const UNDO_EVENT: &str = "ROLLBACK TO SAVEPOINT outbox_event; RELEASE SAVEPOINT outbox_event";

async fn rollback_to(tx: &mut PgConnection, undo: &'static str) -> sqlx::Result<()> {
    sqlx::raw_sql(undo).execute(tx).await?;
    Ok(())
}

fn in_failed_transaction(e: &sqlx::Error) -> bool {
    // 25P02: in_failed_sql_transaction
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}
