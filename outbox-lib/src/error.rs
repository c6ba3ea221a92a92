pub use outbox_core::migrate::MigrateError;
use thiserror::Error;

/// Everything that can go wrong in `outbox`.
///
/// Validation errors are raised before anything is written: an `enqueue` that
/// returns one of them has not touched the caller's transaction.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A required event field (`aggregate_type`, `aggregate_id` or
    /// `event_type`) is empty.
    #[error("event field `{field}` must not be empty")]
    EmptyField {
        /// The name of the empty field.
        field: &'static str,
    },
    /// A name that travels as an AMQP short string (event type, exchange,
    /// routing key, a header name) is over 255 bytes.
    #[error("{field} is {len} bytes; AMQP allows at most 255")]
    NameTooLong {
        /// Which name.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The serialised payload is larger than the configured limit.
    #[error("event payload is {size} bytes, over the limit of {limit} bytes")]
    PayloadTooLarge {
        /// Size of the serialised payload in bytes.
        size: usize,
        /// The configured limit ([`crate::OutboxConfig::max_payload_bytes`]).
        limit: usize,
    },
    /// Event headers must be a JSON object.
    #[error("event headers must be a JSON object, got {found}")]
    HeadersNotObject {
        /// The JSON type that was given instead.
        found: &'static str,
    },
    /// The payload or headers could not be serialised to JSON.
    #[error("could not serialise the event to JSON")]
    Serialize(#[source] serde_json::Error),
    /// A payload given as JSON text is not valid JSON.
    #[error("event payload is not valid JSON")]
    InvalidJson(#[source] serde_json::Error),
    /// A configured schema or table name is not a plain SQL identifier.
    #[error(
        "invalid {what} {value:?}: use 1 to {max} characters of a-z, 0-9 and _, not starting with a digit"
    )]
    InvalidIdentifier {
        /// What the identifier names (`"schema"`, ...).
        what: &'static str,
        /// The rejected value.
        value: String,
        /// The longest accepted length.
        max: usize,
    },
    /// The schema is not migrated, behind this library
    /// ([`MigrateError::NotMigrated`], naming the command that fixes it) or
    /// ahead of it ([`MigrateError::SchemaTooNew`]).
    #[error(transparent)]
    Migration(#[from] MigrateError),
    /// An idempotency key is malformed (HTTP 400).
    #[error("invalid idempotency key: it {reason}")]
    InvalidIdempotencyKey {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The idempotency key was already used with a different request
    /// (HTTP 422). Nothing was written.
    #[error("the idempotency key was already used with a different request")]
    IdempotencyKeyMismatch,
    /// A concurrent request holds the idempotency key (HTTP 409). Retry
    /// after `retry_after`.
    #[error("a concurrent request holds the idempotency key; retry in {retry_after:?}")]
    IdempotencyKeyInUse {
        /// When a retry may succeed.
        retry_after: std::time::Duration,
    },
    /// The idempotency key is no longer held by this attempt: not claimed
    /// in this transaction, already completed, or taken over after its
    /// lease expired.
    #[error("the idempotency key is not held by this attempt (completed or taken over)")]
    IdempotencyKeyNotHeld,
    /// A response body is larger than the recording cap; it was not
    /// recorded.
    #[error("response body is {size} bytes, over the idempotency recording limit of {limit} bytes")]
    ResponseTooLarge {
        /// Size of the body in bytes.
        size: usize,
        /// The configured limit ([`crate::idempotency::IdempotencyConfig::max_response_bytes`]).
        limit: usize,
    },
    /// The handle's [`crate::OrderedAggregates`] names an aggregate type the
    /// database does not order (yet): ordering is the database's, set once
    /// by an operator ([`crate::set_ordered`]).
    #[error(
        "aggregate type {aggregate_type:?} is not ordered in schema {schema:?}; once every producer runs this version, run `outbox-relay ordering add {aggregate_type}` (as the schema's owner)"
    )]
    OrderingNotRegistered {
        /// The aggregate type (`*`: every type).
        aggregate_type: String,
        /// The schema.
        schema: String,
    },
    /// [`Capture::Wal`](crate::Capture::Wal) was asked for, but events
    /// written that way would never be read: the database's `wal_level` is
    /// not `logical`, or the schema's replication slot does not exist.
    /// Nothing was written.
    #[error(
        "write-ahead-log capture is not set up for schema {schema:?}: {reason}; run `outbox-relay migrate --capture wal` (docs/WAL_CAPTURE.md)"
    )]
    WalCaptureNotReady {
        /// The schema.
        schema: String,
        /// What is missing.
        reason: String,
    },
    /// The database returned an error.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl Error {
    /// True when retrying the same operation later may succeed (connection
    /// loss, serialisation failure, deadlock, pool timeout).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) | Error::Migration(MigrateError::Database(e)) => {
                outbox_core::db::is_transient(e)
            }
            _ => false,
        }
    }

    /// True when the error is a unique-constraint violation.
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, Error::Database(sqlx::Error::Database(e)) if e.is_unique_violation())
    }
}

impl From<outbox_core::InvalidIdentifier> for Error {
    fn from(e: outbox_core::InvalidIdentifier) -> Self {
        Error::InvalidIdentifier {
            what: e.what,
            value: e.value,
            max: e.max,
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
