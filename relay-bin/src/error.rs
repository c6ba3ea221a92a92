use thiserror::Error;

/// Errors of the relay engine.
///
/// Broker outcomes of single events (nacked, returned, timed out) are not
/// errors of the relay: they are [`crate::Outcome`]s that reschedule the event.
/// These variants stop a batch; the supervisor reconnects and retries.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The outbox library refused (not migrated, bad schema name, ...).
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// Connecting to the broker failed.
    #[error("cannot connect to the broker at {url}")]
    BrokerConnect {
        /// The broker URL, password redacted.
        url: String,
        /// What lapin reported.
        #[source]
        source: lapin::Error,
    },
    /// The broker connection or channel was lost or refused an operation.
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    /// The broker closed a publishing channel (the batch was settled; the
    /// channel is replaced).
    #[error("broker closed the channel: {0}")]
    ChannelClosed(String),
    /// On shutdown, the batches in flight did not finish within
    /// [`RelayConfig::drain_timeout`](crate::RelayConfig::drain_timeout);
    /// they were abandoned (rolled back) and their events stay in the
    /// outbox, to be published again.
    #[error(
        "batches in flight did not finish within the drain timeout of {0:?}; their events stay in the outbox and will be published again"
    )]
    DrainTimedOut(std::time::Duration),
    /// A broker operation did not finish within its timeout.
    #[error("broker did not answer {what} within {timeout:?}")]
    BrokerTimeout {
        /// The operation that timed out.
        what: &'static str,
        /// The bound that was exceeded.
        timeout: std::time::Duration,
    },
}

impl Error {
    /// True when the broker side failed (the supervisor reconnects).
    pub fn is_broker(&self) -> bool {
        matches!(
            self,
            Error::Broker(_)
                | Error::BrokerConnect { .. }
                | Error::BrokerTimeout { .. }
                | Error::ChannelClosed(_)
        )
    }

    /// True when the broker refused in a way no retry can fix (see
    /// [`Error::is_transient`]): `Relay::run` returns such an error.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Error::BrokerConnect { source, .. } | Error::Broker(source) if is_refusal(source))
    }

    /// True when a later retry of the same operation may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_) | Error::DrainTimedOut(_) => false,
            Error::Outbox(e) => e.is_transient(),
            Error::Database(e) => outbox::__private::is_transient_db(e),
            Error::BrokerConnect { source, .. } | Error::Broker(source) => !is_refusal(source),
            Error::BrokerTimeout { .. } | Error::ChannelClosed(_) => true,
        }
    }
}

/// The broker refused in a way no retry can fix: a login or permission
/// refused (403 `ACCESS_REFUSED`), a missing virtual host (530
/// `NOT_ALLOWED`), a declaration at odds with what exists (406
/// `PRECONDITION_FAILED`, such as `--declare-exchange` of another type).
/// (The same rule as the consumer's; one shared home is issue 15's.)
fn is_refusal(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
    ))
}

/// The result type of the relay engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;
