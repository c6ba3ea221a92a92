//! One batch, one transaction: dedup every delivery in one statement, lock
//! the sequences of its ordered aggregates, run the handler for fresh
//! events only (in sequence, when ordered), isolate each event's effect,
//! commit.
//!
//! By concept: `transaction.rs` ([`process`]: the passes, each in a
//! transaction of its own, and their commit), `plan.rs` (pure planners:
//! which ids to claim, which events to run, which to forget) and `pass.rs`
//! (one pass of the handlers: per event, with or without savepoints, or
//! the batch handler).

mod pass;
mod plan;
mod transaction;

use tracing::Span;

use crate::event::Event;
use crate::handler::{Conflict, Outcome};
use crate::sequence::{Deferral, Position};

pub(crate) use self::transaction::process;

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
    /// Bound on one statement of the consumer's own (its lock wait
    /// included; see [`bounded`]).
    pub(crate) statement_bound: std::time::Duration,
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

/// A database round trip of the consumer's own, bounded by `bound` from
/// its side: past it, an I/O timeout, which the transaction stage waits
/// out like any unreachable database (and after which
/// [`transaction::process`] closes the connection instead of giving it
/// back to the pool).
pub(crate) async fn bounded<T>(
    bound: std::time::Duration,
    f: impl Future<Output = sqlx::Result<T>>,
) -> sqlx::Result<T> {
    match tokio::time::timeout(bound, f).await {
        Ok(r) => r,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the database did not answer within {bound:?}; its connection is closed"),
        ))),
    }
}

fn in_failed_transaction(e: &sqlx::Error) -> bool {
    // 25P02: in_failed_sql_transaction
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}
