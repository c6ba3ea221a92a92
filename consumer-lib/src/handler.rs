use futures_util::future::BoxFuture;
use sqlx::PgConnection;

use crate::event::Event;

/// What a handler decided about one event.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Done: the effect commits with the inbox record, then the message is
    /// acked.
    Ack,
    /// Transient failure: the effect is rolled back and the message comes
    /// back later through `<queue>.retry`, with exponential backoff, up to
    /// [`max_retries`](crate::ConsumerConfig::max_retries) times; then it is
    /// dead-lettered.
    Retry(String),
    /// Permanent failure: the effect is rolled back and the message goes to
    /// `<queue>.dlq` with the reason in header `x-dead-letter-reason`.
    Reject(String),
    /// The transaction lost to a concurrent one: PostgreSQL aborted it with
    /// a deadlock or a serialization failure. The whole batch transaction
    /// is rolled back and run again at once (its handlers are called
    /// again), counted in `outbox_consumer_transaction_retries_total`; the
    /// event does not go through the retry queue and its retry count does
    /// not move. `Outcome::from(e)` gives it for such a [`sqlx::Error`].
    Conflict(Conflict),
}

/// Why PostgreSQL rolled a transaction back so that a concurrent one could
/// go on (SQLSTATE class 40). It says nothing about the events: their batch
/// runs again at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Conflict {
    /// `deadlock_detected` (40P01): two transactions each waited for a lock
    /// the other held; PostgreSQL aborted one after `deadlock_timeout`.
    Deadlock,
    /// `serialization_failure` (40001): a `REPEATABLE READ` or
    /// `SERIALIZABLE` transaction saw a concurrent change.
    Serialization,
}

impl Conflict {
    /// The conflict `e` reports, if it is one.
    pub fn of(e: &sqlx::Error) -> Option<Self> {
        let sqlx::Error::Database(db) = e else {
            return None;
        };
        match db.code().as_deref() {
            Some("40P01") => Some(Conflict::Deadlock),
            Some("40001") => Some(Conflict::Serialization),
            _ => None,
        }
    }

    /// The `reason` label of `outbox_consumer_transaction_retries_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Conflict::Deadlock => "deadlock",
            Conflict::Serialization => "serialization",
        }
    }
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Conflict::Deadlock => "deadlock detected",
            Conflict::Serialization => "serialization failure",
        })
    }
}

/// A database error as a handler's outcome: a deadlock or a serialization
/// failure is an [`Outcome::Conflict`] (the batch runs again at once),
/// any other error an [`Outcome::Retry`] with the error as its reason.
impl From<sqlx::Error> for Outcome {
    fn from(e: sqlx::Error) -> Self {
        match Conflict::of(&e) {
            Some(c) => Outcome::Conflict(c),
            None => Outcome::retry(e),
        }
    }
}

impl Outcome {
    /// Shorthand for [`Outcome::Retry`].
    pub fn retry(reason: impl std::fmt::Display) -> Self {
        Outcome::Retry(reason.to_string())
    }

    /// Shorthand for [`Outcome::Reject`].
    pub fn reject(reason: impl std::fmt::Display) -> Self {
        Outcome::Reject(reason.to_string())
    }

    pub(crate) fn is_ack(&self) -> bool {
        matches!(self, Outcome::Ack)
    }

    pub(crate) fn label(&self) -> &'static str {
        match self {
            Outcome::Ack => "processed",
            Outcome::Retry(_) | Outcome::Conflict(_) => "retried",
            Outcome::Reject(_) => "rejected",
        }
    }

    /// The conflict this outcome reports, if it is one.
    pub(crate) fn conflict(&self) -> Option<Conflict> {
        match self {
            Outcome::Conflict(c) => Some(*c),
            _ => None,
        }
    }
}

/// What a [`BatchHandler`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchOutcome {
    /// One outcome for every event of the batch. Anything but `Ack` rolls
    /// back the handler's whole effect.
    All(Outcome),
    /// One outcome per event, in order. The handler's effects commit as
    /// they are: it must not have applied the effect of an event it does
    /// not ack (that event's inbox record is removed so it can run again).
    Each(Vec<Outcome>),
}

/// Applies one event's effect. Runs only for the first sighting of an event
/// id (per consumer name), inside the transaction that records it in the
/// inbox; whatever it writes through `conn` commits together with that
/// record, or not at all.
///
/// The transaction may be retried (after a database error, a deadlock, or
/// to isolate a failing event of the batch), so the handler may be called
/// more than once for an event, but its database effect commits exactly
/// once. Keep effects outside the database out of handlers. Return a
/// database error as `e.into()` ([`Outcome::from`]): a deadlock or a
/// serialization failure then reruns the batch at once instead of sending
/// the event through the retry queue.
///
/// ```
/// use outbox_consumer::{Event, Handler, Outcome};
/// use sqlx::PgConnection;
///
/// struct Stock;
///
/// impl Handler for Stock {
///     async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
///         #[derive(serde::Deserialize)]
///         struct Reserved { sku: String, qty: i32 }
///         let Ok(r) = event.payload::<Reserved>() else {
///             return Outcome::reject("payload is not a Reserved event");
///         };
///         match sqlx::query("UPDATE stock SET qty = qty - $2 WHERE sku = $1")
///             .bind(&r.sku)
///             .bind(r.qty)
///             .execute(conn)
///             .await
///         {
///             Ok(_) => Outcome::Ack,
///             // A deadlock: the batch runs again at once; else a retry.
///             Err(e) => e.into(),
///         }
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Applies `event`'s effect through `conn` (the open transaction).
    fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event,
    ) -> impl Future<Output = Outcome> + Send;
}

/// Applies the effects of all fresh events of a batch at once, for
/// set-based writes (one `UPDATE ... FROM unnest(...)` instead of one round
/// trip per event). Same transaction rules as [`Handler`]; duplicates are
/// already filtered out and each event appears once. Seeing the whole
/// batch, it can also take its rows' locks in one order (by key), so that
/// concurrent instances never deadlock on them.
pub trait BatchHandler: Send + Sync + 'static {
    /// Applies the effects of `events` through `conn` (the open
    /// transaction).
    fn handle_batch(
        &self,
        conn: &mut PgConnection,
        events: &[Event],
    ) -> impl Future<Output = BatchOutcome> + Send;
}

/// Object-safe forms of the handler traits, so the consumer is not generic.
pub(crate) trait DynHandler: Send + Sync {
    fn handle_dyn<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Outcome>;
}

impl<H: Handler> DynHandler for H {
    fn handle_dyn<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(self.handle(conn, event))
    }
}

pub(crate) trait DynBatchHandler: Send + Sync {
    fn handle_batch_dyn<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [Event],
    ) -> BoxFuture<'a, BatchOutcome>;
}

impl<B: BatchHandler> DynBatchHandler for B {
    fn handle_batch_dyn<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [Event],
    ) -> BoxFuture<'a, BatchOutcome> {
        Box::pin(self.handle_batch(conn, events))
    }
}

/// The handler a consumer runs.
#[derive(Clone)]
pub(crate) enum Handlers {
    PerEvent(std::sync::Arc<dyn DynHandler>),
    Batch(std::sync::Arc<dyn DynBatchHandler>),
}
