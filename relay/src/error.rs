pub use outbox_core::amqp::BrokerError;
use thiserror::Error;

/// Errors of the relay engine.
///
/// Broker outcomes of single events (nacked, returned, timed out) are not
/// errors of the relay: they are receipts that reschedule the event.
/// These variants stop a batch; the supervisor reconnects and retries.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The outbox library refused (not migrated, bad schema name, ...).
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The broker failed, refused, timed out, blocked publishing or
    /// closed a channel; the supervisor reconnects and retries, unless it
    /// is a refusal ([`Error::is_refusal`]).
    #[error(transparent)]
    Broker(BrokerError),
    /// On shutdown, the batches in flight did not finish within
    /// [`RelayConfig::drain_timeout`](crate::RelayConfig::drain_timeout);
    /// they were abandoned (rolled back) and their events stay in the
    /// outbox, to be published again.
    #[error(
        "batches in flight did not finish within the drain timeout of {0:?}; their events stay in the outbox and will be published again"
    )]
    DrainTimedOut(std::time::Duration),
    /// The replication connection of the write-ahead-log capture failed
    /// (connect, authentication, or the stream broke); the reader
    /// reconnects and reads again from the slot's confirmed position.
    #[error("replication stream: {0}")]
    Replication(String),
    /// The write-ahead-log capture cannot run and no retry will fix it: the
    /// slot is missing, was invalidated (`wal_status = lost`: the WAL it
    /// needed was removed, so events written meanwhile are not in it any
    /// more), or the replication connection was refused. `Relay::run`
    /// returns it.
    #[error("write-ahead-log capture: {0}")]
    WalRefused(String),
    /// A database call did not finish within
    /// [`RelayConfig::database_timeout`](crate::RelayConfig::database_timeout)
    /// (a link gone silent, a server that stopped answering): its
    /// connection was discarded, and the work is retried on a fresh one.
    #[error("database did not answer {what} within {timeout:?}; its connection is discarded")]
    DatabaseTimeout {
        /// The call that timed out.
        what: &'static str,
        /// The bound that was exceeded.
        timeout: std::time::Duration,
    },
}

impl Error {
    /// True when the broker side failed (the supervisor reconnects).
    pub fn is_broker(&self) -> bool {
        matches!(self, Error::Broker(_))
    }

    /// True when the broker refused in a way no retry can fix (see
    /// [`Error::is_transient`]): `Relay::run` returns such an error.
    pub fn is_refusal(&self) -> bool {
        match self {
            Error::Broker(e) => e.is_refusal(),
            Error::WalRefused(_) => true,
            _ => false,
        }
    }

    /// True when the database could not be reached (whatever the
    /// statement): a call timed out, the connection was lost or refused,
    /// the server is shutting down or starting.
    pub(crate) fn is_unreachable(&self) -> bool {
        match self {
            Error::DatabaseTimeout { .. } => true,
            Error::Database(e) | Error::Outbox(outbox::Error::Database(e)) => {
                outbox_core::db::is_unreachable(e)
            }
            _ => false,
        }
    }

    /// True when a later retry of the same operation may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_) | Error::DrainTimedOut(_) | Error::WalRefused(_) => false,
            Error::Replication(_) | Error::DatabaseTimeout { .. } => true,
            Error::Outbox(e) => e.is_transient(),
            Error::Database(e) => outbox_core::db::is_transient(e),
            Error::Broker(e) => e.is_transient(),
        }
    }
}

impl From<lapin::Error> for Error {
    fn from(source: lapin::Error) -> Self {
        Error::Broker(BrokerError::Failed {
            what: "a broker operation",
            source,
        })
    }
}

impl From<BrokerError> for Error {
    fn from(e: BrokerError) -> Self {
        match e {
            BrokerError::NoUrl => Error::Config(ConfigError::Url(e.to_string())),
            e => Error::Broker(e),
        }
    }
}

impl From<outbox_core::InvalidIdentifier> for Error {
    fn from(e: outbox_core::InvalidIdentifier) -> Self {
        Error::Outbox(e.into())
    }
}

/// Why a [`RelayConfig`](crate::RelayConfig) (or a setting given to an
/// operator command) was refused. The text names the setting and never
/// quotes a URL.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A number outside its range.
    #[error("{setting} must be {allowed}, got {got}")]
    OutOfRange {
        /// The setting, in words ("batch size").
        setting: &'static str,
        /// What it may be ("1..=10000").
        allowed: &'static str,
        /// What it was.
        got: i64,
    },
    /// A duration that must be greater than zero.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// A maximum below its minimum.
    #[error("{max} must be at least {min}")]
    Inverted {
        /// The maximum's setting ("retry max").
        max: &'static str,
        /// The minimum's setting ("retry base").
        min: &'static str,
    },
    /// A duration below its floor.
    #[error("{setting} must be at least {floor:?}")]
    TooShort {
        /// The setting ("WAL sender timeout").
        setting: &'static str,
        /// The least it may be.
        floor: std::time::Duration,
    },
    /// An exchange type RabbitMQ does not declare.
    #[error("exchange type must be topic, direct, fanout or headers, got {0:?}")]
    ExchangeKind(String),
    /// `declare_exchange` with the default exchange `""`.
    #[error("cannot declare the default exchange \"\" (it always exists)")]
    DeclareDefaultExchange,
    /// A broker or database URL that cannot be used: what is wrong, never
    /// the value (it may hold a password).
    #[error("{0}")]
    Url(String),
    /// A replication slot name PostgreSQL would refuse.
    #[error(
        "slot name {0:?} is not valid: lower-case letters, digits and underscores, starting with a letter or underscore, at most 63 bytes"
    )]
    SlotName(String),
}

/// The result type of the relay engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;
