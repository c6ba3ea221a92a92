use std::time::Duration;

pub use outbox_core::amqp::BrokerError;
use thiserror::Error;

/// Everything that can go wrong in `outbox-consumer`.
///
/// A consumer's [`run`](crate::Consumer::run) survives the transient ones by
/// itself (it backs off and reconnects); it returns only on shutdown or on an
/// error retrying cannot fix ([`Error::is_transient`] is false).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The database returned an error.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// A broker operation failed, was refused or did not complete in time
    /// (connection refused or lost, channel closed, queue missing, ...).
    #[error(transparent)]
    Broker(BrokerError),
    /// The broker cancelled our consumer (for example: the queue was
    /// deleted) or the delivery stream ended.
    #[error("consumer on queue {queue:?} was cancelled by the broker")]
    ConsumerCancelled {
        /// The queue consumed from.
        queue: String,
    },
    /// The broker nacked a republish (to the retry queue or the DLQ).
    #[error("broker nacked the republish to {queue:?}")]
    Nacked {
        /// The target queue.
        queue: String,
    },
    /// A republish was returned as unroutable (the retry queue or DLQ is
    /// missing).
    #[error("republish to {queue:?} was returned: {code} {text}")]
    Returned {
        /// The target queue.
        queue: String,
        /// AMQP reply code.
        code: u16,
        /// Broker's reply text.
        text: String,
    },
    /// The broker lacks an exchange type because its plugin is not
    /// enabled; the broker closed the connection.
    #[error(
        "the broker has no exchange type {exchange_type}: enable it with `rabbitmq-plugins enable {plugin}`"
    )]
    MissingPlugin {
        /// The exchange type refused.
        exchange_type: &'static str,
        /// The RabbitMQ plugin that provides it.
        plugin: &'static str,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// A queue exists with another type or other arguments than declared
    /// (RabbitMQ's 406 `PRECONDITION_FAILED`). Retrying cannot help: an
    /// existing queue keeps its type and arguments until deleted.
    #[error(
        "queue {queue:?} exists with other arguments than declared ({detail}); a queue cannot change type or arguments in place: declare it as it is (QueueType::Classic for a classic queue, the same delivery limit and max length), or move it to the new declaration (docs/OPERATIONS.md, \"Moving a classic queue to quorum\")"
    )]
    QueueMismatch {
        /// The queue.
        queue: String,
        /// The broker's words: which argument, what it received, what the
        /// queue has.
        detail: String,
    },
    /// An error from `outbox` (invalid schema name, inbox not migrated).
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
    /// The consumer configuration is invalid.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
}

impl Error {
    /// True when retrying the same operation later may succeed: broker
    /// trouble of any kind, and database connection loss, deadlocks,
    /// serialisation failures and pool timeouts.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => outbox_core::db::is_transient(e),
            Error::Broker(e) => e.is_transient(),
            Error::ConsumerCancelled { .. } | Error::Nacked { .. } | Error::Returned { .. } => true,
            Error::Outbox(e) => e.is_transient(),
            Error::Config(_) | Error::MissingPlugin { .. } | Error::QueueMismatch { .. } => false,
        }
    }
}

impl From<BrokerError> for Error {
    fn from(e: BrokerError) -> Self {
        match e {
            BrokerError::NoUrl => Error::Config(e.to_string()),
            e => Error::Broker(e),
        }
    }
}

impl From<outbox_core::InvalidIdentifier> for Error {
    fn from(e: outbox_core::InvalidIdentifier) -> Self {
        Error::Outbox(e.into())
    }
}

impl From<outbox_core::migrate::MigrateError> for Error {
    fn from(e: outbox_core::migrate::MigrateError) -> Self {
        Error::Outbox(e.into())
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Awaits a broker operation, bounded by `timeout`.
pub(crate) async fn bounded<T>(
    what: &'static str,
    timeout: Duration,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T> {
    Ok(outbox_core::amqp::bounded(what, timeout, f).await?)
}

/// [`bounded`], not counting the time the broker blocks `conn`
/// ([`outbox_core::amqp::bounded_unblocked`]).
pub(crate) async fn bounded_unblocked<T>(
    what: &'static str,
    timeout: Duration,
    conn: &lapin::Connection,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T> {
    Ok(outbox_core::amqp::bounded_unblocked(what, timeout, conn, f).await?)
}
