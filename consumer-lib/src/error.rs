use std::time::Duration;

use thiserror::Error;

/// Everything that can go wrong in `consumer-lib`.
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
    /// A broker operation failed (connection refused or lost, channel
    /// closed, queue missing, ...).
    #[error("broker error during {what}: {source}")]
    Broker {
        /// The AMQP operation that failed.
        what: &'static str,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// A broker operation did not complete in time.
    #[error("broker did not answer {what} within {timeout:?}")]
    BrokerTimeout {
        /// The AMQP operation that timed out.
        what: &'static str,
        /// The configured bound.
        timeout: Duration,
    },
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
    /// An error from `outbox-lib` (invalid schema name, inbox not migrated).
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
            Error::Database(e) => outbox::__private::is_transient_db(e),
            Error::Broker { what, source } => !is_refusal(what, source),
            Error::BrokerTimeout { .. }
            | Error::ConsumerCancelled { .. }
            | Error::Nacked { .. }
            | Error::Returned { .. } => true,
            Error::Outbox(e) => e.is_transient(),
            Error::Config(_) | Error::MissingPlugin { .. } | Error::QueueMismatch { .. } => false,
        }
    }
}

/// The broker refused `what` in a way no retry can fix: a login or
/// permission refused (403 `ACCESS_REFUSED`), a missing virtual host (530
/// `NOT_ALLOWED`), a declaration at odds with what exists (406
/// `PRECONDITION_FAILED` on a declare: another queue type or other
/// arguments). A 406 elsewhere is routine and retried (RabbitMQ's
/// `consumer_timeout` on a delivery held through a long database outage,
/// an unknown delivery tag); a missing queue (404) may be declared later.
pub(crate) fn is_refusal(what: &str, e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return false;
    };
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
        | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => true,
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => what.contains("declare"),
        _ => false,
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
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(Error::Broker { what, source }),
        Err(_) => Err(Error::BrokerTimeout { what, timeout }),
    }
}
