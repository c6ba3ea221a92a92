//! One batch, one transaction: dedup every delivery in one statement, lock
//! the sequences of its ordered aggregates, run the handler for fresh
//! events only (in sequence, when ordered), isolate each event's effect,
//! commit.

use std::collections::HashSet;

use futures_util::FutureExt as _;
use sqlx::{PgConnection, PgPool};
use tracing::{Instrument as _, Span};

use crate::dedup::Inbox;
use crate::event::Event;
use crate::handler::{BatchOutcome, Conflict, Handlers, Outcome};
use crate::sequence::{Deferral, Position, Sequencer, Sequences, Turn};

/// The decoded deliveries of one batch.
pub(crate) struct Batch<'a> {
    pub(crate) events: &'a [Event],
    /// One span per event.
    pub(crate) spans: &'a [Span],
    /// Per event, its position in its aggregate when it is sequenced and
    /// ordering is on; otherwise empty or `None`.
    pub(crate) positions: &'a [Option<Position>],
    /// Bound on one handler call.
    pub(crate) handler_timeout: std::time::Duration,
}

impl Batch<'_> {
    fn position(&self, i: usize) -> Option<&Position> {
        self.positions.get(i).and_then(Option::as_ref)
    }
}

/// What happened to one event of a committed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Already in the inbox (processed before, or earlier in this batch):
    /// ack without effect.
    Duplicate,
    /// Sequenced, at or below its aggregate's last applied number: ack
    /// without effect.
    Stale { seq: i64, last: i64 },
    /// Sequenced and not applicable yet (a gap, or held back behind a
    /// failed event of its aggregate): back through the retry queue,
    /// counted as a deferral, not a handler retry.
    Deferred(Deferral),
    /// Fresh; the handler decided.
    Handled(Outcome),
}

/// Why a batch's transaction committed nothing.
#[derive(Debug)]
pub(crate) enum Failure {
    /// It lost to a concurrent transaction (a deadlock or a serialization
    /// failure, raised by one of its statements or reported by a handler
    /// as [`Outcome::Conflict`]): worth running again at once.
    Conflict(Conflict),
    /// Any other database error.
    Database(sqlx::Error),
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        match Conflict::of(&e) {
            Some(c) => Failure::Conflict(c),
            None => Failure::Database(e),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Conflict(c) => c.fmt(f),
            Failure::Database(e) => e.fmt(f),
        }
    }
}

/// Processes `batch` in one transaction and commits it. `Err` means
/// nothing committed; the caller retries the batch or lets it be
/// redelivered. `sequences` is `Some` when ordering is on (per-event
/// handlers only).
pub(crate) async fn process(
    pool: &PgPool,
    begin: &sqlx::SqlStr,
    inbox: &Inbox,
    sequences: Option<&Sequences>,
    handlers: &Handlers,
    batch: &Batch<'_>,
) -> Result<Vec<Verdict>, Failure> {
    let events = batch.events;
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
        // Never raced against a timeout (a cancelled begin can leak an
        // open transaction into the pool): the SET LOCALs sent with it bound
        // the database side.
        let mut tx = pool.begin_with(begin.clone()).await?;
        let fresh = inbox.claim(&mut tx, &keys).await?;
        let fresh: HashSet<&str> = fresh.iter().map(String::as_str).collect();
        let (to_handle, passes) = select(batch, &fresh, sequences.is_some());
        // After the inbox claim, in every instance: one lock order.
        let mut order = match sequences {
            Some(s) => {
                s.lock(&mut tx, passes.iter().filter_map(|&i| batch.position(i)))
                    .await?
            }
            None => None,
        };
        let mut verdicts = vec![Verdict::Duplicate; events.len()];
        let pass = Pass {
            isolated,
            known: known.take(),
            order: order.as_mut(),
        };
        let ran = run_handlers(
            &mut tx,
            handlers,
            batch,
            &fresh,
            (&to_handle, &passes),
            pass,
            &mut verdicts,
        );
        match ran.await? {
            Ran::Done => {}
            Ran::Again(failure) => {
                known = failure;
                tx.rollback().await?;
                continue;
            }
            Ran::AllFailed => {
                // Nothing to keep: the duplicates' inbox rows were
                // committed before, the fresh ones must not be.
                tx.rollback().await?;
                return Ok(verdicts);
            }
        }
        let failed = unapplied(events, &to_handle, &verdicts);
        // Also the guard against a handler that returned Ack after one of
        // its statements failed: in an aborted transaction these statements
        // error, where COMMIT would silently roll back and we would ack.
        match finish(&mut tx, inbox, sequences.zip(order.as_ref()), &failed).await {
            Ok(()) => {}
            Err(e) if isolated_only && in_failed_transaction(&e) => {
                tx.rollback().await?;
                for &i in &to_handle {
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
            Err(e) => return Err(e.into()),
        }
        tx.commit().await?;
        return Ok(verdicts);
    }
    unreachable!("the isolated pass always returns")
}

/// The deliveries whose handler runs (the first copy of each fresh id),
/// and those the pass looks at: the same, plus with sequencing every
/// sequenced copy, since each holds a number of its aggregate whether it
/// runs or not (the id was applied before, or comes twice in this batch):
/// the sequencer must see each one, or the aggregate would wait for a
/// number for ever. An id enqueued again after its first copy left the
/// outbox comes back with a new number. The handler runs for the copy
/// whose number is next.
fn select(batch: &Batch<'_>, fresh: &HashSet<&str>, sequencing: bool) -> (Vec<usize>, Vec<usize>) {
    let events = batch.events;
    // Only the first delivery of a fresh key runs; later copies in the
    // same batch are duplicates.
    let mut first = HashSet::new();
    let to_handle: Vec<usize> = (0..events.len())
        .filter(|&i| fresh.contains(events[i].id()) && first.insert(events[i].id()))
        .collect();
    let passes: Vec<usize> = if sequencing {
        (0..events.len())
            .filter(|&i| to_handle.binary_search(&i).is_ok() || batch.position(i).is_some())
            .collect()
    } else {
        to_handle.clone()
    };
    (to_handle, passes)
}

/// How one pass of the handlers ended.
enum Ran {
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
async fn run_handlers(
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

/// Fresh events not applied (failed, deferred, stale): they lose their
/// inbox row, so a later copy or a replay runs again. Per id: with
/// sequencing, another copy of it may be the one applied.
fn unapplied<'e>(events: &'e [Event], to_handle: &[usize], verdicts: &[Verdict]) -> Vec<&'e str> {
    let acked: HashSet<&str> = (0..events.len())
        .filter(|&i| matches!(verdicts[i], Verdict::Handled(Outcome::Ack)))
        .map(|i| events[i].id())
        .collect();
    to_handle
        .iter()
        .map(|&i| events[i].id())
        .filter(|id| !acked.contains(id))
        .collect()
}

/// Records the sequence numbers the batch moved, then forgets the inbox
/// rows of `failed`: the last statements before COMMIT.
async fn finish(
    tx: &mut PgConnection,
    inbox: &Inbox,
    order: Option<(&Sequences, &Sequencer)>,
    failed: &[&str],
) -> sqlx::Result<()> {
    if let Some((sequences, order)) = order {
        sequences.advance(&mut *tx, order).await?;
    }
    inbox.forget(tx, failed).await
}

struct Pass<'s> {
    /// Savepoint per event.
    isolated: bool,
    /// An event whose (failing) outcome is already decided.
    known: Option<(usize, Outcome)>,
    /// Sequencing on: the sequence state of the batch's aggregates.
    order: Option<&'s mut Sequencer>,
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
    if isolated {
        sqlx::raw_sql("SAVEPOINT outbox_event")
            .execute(&mut *tx)
            .await?;
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
            match sqlx::raw_sql("SELECT 1").execute(&mut *tx).await {
                Ok(_) => {}
                Err(e) if in_failed_transaction(&e) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Some(outcome));
    }
    if !outcome.is_ack() {
        rollback_to(tx, UNDO_EVENT).await?;
        return Ok(Some(outcome));
    }
    match sqlx::raw_sql("RELEASE SAVEPOINT outbox_event")
        .execute(&mut *tx)
        .await
    {
        Ok(_) => Ok(Some(outcome)),
        Err(e) if in_failed_transaction(&e) => {
            rollback_to(tx, UNDO_EVENT).await?;
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
    let fresh: Vec<Event> = to_handle.iter().map(|&i| events[i].clone()).collect();
    let call = std::panic::AssertUnwindSafe(h.handle_batch_dyn(&mut *tx, &fresh)).catch_unwind();
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

fn in_failed_transaction(e: &sqlx::Error) -> bool {
    // 25P02: in_failed_sql_transaction
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}
