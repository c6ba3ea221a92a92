//! The batch's transaction: [`process`] runs a pass without savepoints,
//! then, after a failure, one isolated pass, each in a transaction of its
//! own, and commits the pass that decided.

use std::collections::HashSet;

use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

use super::pass::{Pass, Ran, run_handlers};
use super::plan::{inbox_keys, select, unapplied};
use super::{Batch, Failure, Verdict, bounded, in_failed_transaction};
use crate::handler::{Handlers, Outcome};
use crate::inbox::Inbox;
use crate::sequence::{Sequencer, Sequences};

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
    let run = BatchTx {
        begin,
        inbox,
        sequences,
        handlers,
        batch,
        keys: inbox_keys(batch.events),
    };
    // Per-event handlers first run without savepoints (one round trip less
    // per event); the first failure rolls back and reruns the batch with a
    // savepoint per event, so a failing event cannot undo the others.
    // The failure found by the first pass is kept, not asked again: each
    // handler decision about a failing event is made once.
    //
    // The connection is taken here, not by the passes: one whose link went
    // silent (a round trip past its bound, `super::bounded`) or failed is
    // closed, never given back to the pool, whose test of a returned
    // connection (a ping) has no bound. A cancelled BEGIN cannot leak an
    // open transaction into the pool this way.
    let mut conn = bounded(batch.statement_bound, pool.acquire()).await?;
    let mut known: Option<(usize, Outcome)> = None;
    let mut end = None;
    for isolated in [run.isolated_only(), true] {
        match run.pass(&mut conn, isolated, known.take()).await {
            Ok(PassEnd::Decided(verdicts)) => {
                end = Some(Ok(verdicts));
                break;
            }
            Ok(PassEnd::Rerun(failure)) => known = failure,
            Err(e) => {
                end = Some(Err(e));
                break;
            }
        }
    }
    let end = end.expect("the isolated pass always returns");
    if let Err(Failure::Database(sqlx::Error::Io(_) | sqlx::Error::Protocol(_))) = &end {
        conn.close_on_drop();
    }
    end
}

/// What each pass of [`process`] runs with.
struct BatchTx<'a> {
    begin: &'a sqlx::SqlStr,
    inbox: &'a Inbox,
    sequences: Option<&'a Sequences>,
    handlers: &'a Handlers,
    batch: &'a Batch<'a>,
    /// From [`inbox_keys`].
    keys: Vec<&'a str>,
}

/// How one pass of [`process`] ended, its transaction committed or
/// rolled back.
enum PassEnd {
    /// The batch's verdicts: final.
    Decided(Vec<Verdict>),
    /// Rolled back: rerun isolated, with the failing event's outcome when
    /// it is known.
    Rerun(Option<(usize, Outcome)>),
}

impl BatchTx<'_> {
    /// A batch handler has no pass without savepoints to fall back from.
    fn isolated_only(&self) -> bool {
        matches!(self.handlers, Handlers::Batch(_))
    }

    /// One pass in a transaction of its own: claim the ids in the inbox,
    /// lock the sequences, run the handlers (`isolated`: a savepoint per
    /// event; `known`: an event whose failing outcome is already decided),
    /// then [`BatchTx::close`] it.
    async fn pass(
        &self,
        conn: &mut PgConnection,
        isolated: bool,
        known: Option<(usize, Outcome)>,
    ) -> Result<PassEnd, Failure> {
        let batch = self.batch;
        let bound = batch.statement_bound;
        // The SET LOCALs sent with the BEGIN bound the database side; the
        // bound here is the client's (a cancelled BEGIN's connection is
        // closed, see `process`).
        let mut tx = bounded(bound, Connection::begin_with(conn, self.begin.clone())).await?;
        let fresh = bounded(bound, self.inbox.record(&mut tx, &self.keys)).await?;
        let fresh: HashSet<&str> = fresh.iter().map(String::as_str).collect();
        let (to_handle, passes) = select(batch, &fresh, self.sequences.is_some());
        // After the inbox's record of the keys, in every instance: one lock order.
        let mut order = match self.sequences {
            Some(s) => {
                let positions = passes.iter().filter_map(|&i| batch.position(i));
                bounded(bound, s.lock(&mut tx, positions)).await?
            }
            None => None,
        };
        let mut verdicts = vec![Verdict::Duplicate; batch.events.len()];
        let pass = Pass {
            isolated,
            known,
            order: order.as_mut(),
        };
        let ran = run_handlers(
            &mut tx,
            self.handlers,
            batch,
            &fresh,
            (&to_handle, &passes),
            pass,
            &mut verdicts,
        );
        match ran.await? {
            Ran::Done => {}
            Ran::Again(failure) => {
                bounded(bound, tx.rollback()).await?;
                return Ok(PassEnd::Rerun(failure));
            }
            Ran::AllFailed => {
                // Nothing to keep: the duplicates' inbox rows were
                // committed before, the fresh ones must not be.
                bounded(bound, tx.rollback()).await?;
                return Ok(PassEnd::Decided(verdicts));
            }
        }
        self.close(tx, order.as_ref(), isolated, &to_handle, verdicts)
            .await
    }

    /// The end of a pass whose handlers ran: the last statements
    /// ([`finish`]), then COMMIT; or a rollback when they find the
    /// transaction aborted.
    async fn close(
        &self,
        mut tx: Transaction<'_, Postgres>,
        order: Option<&Sequencer>,
        isolated: bool,
        to_handle: &[usize],
        mut verdicts: Vec<Verdict>,
    ) -> Result<PassEnd, Failure> {
        let failed = unapplied(self.batch.events, to_handle, &verdicts);
        // Also the guard against a handler that returned Ack after one of
        // its statements failed: in an aborted transaction these statements
        // error, where COMMIT would silently roll back and we would ack.
        let bound = self.batch.statement_bound;
        let finished = finish(&mut tx, self.inbox, self.sequences.zip(order), &failed);
        match bounded(bound, finished).await {
            Ok(()) => {}
            Err(e) if self.isolated_only() && in_failed_transaction(&e) => {
                bounded(bound, tx.rollback()).await?;
                for &i in to_handle {
                    verdicts[i] = Verdict::Handled(Outcome::retry(
                        "batch handler returned Ack but one of its statements failed",
                    ));
                }
                return Ok(PassEnd::Decided(verdicts));
            }
            // A handler said Ack but left the transaction aborted: redo
            // with savepoints, which pins it on that event.
            Err(e) if !isolated && in_failed_transaction(&e) => {
                bounded(bound, tx.rollback()).await?;
                return Ok(PassEnd::Rerun(None));
            }
            Err(e) => return Err(e.into()),
        }
        bounded(bound, tx.commit()).await?;
        Ok(PassEnd::Decided(verdicts))
    }
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
