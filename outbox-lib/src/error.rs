use thiserror::Error;

/// Everything that can go wrong in `outbox-lib`.
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
    /// The database has not been migrated (or is behind this library).
    #[error(
        "{what} in schema {schema:?} is not migrated (found version {found}, need {needed}); run `{fix}`"
    )]
    NotMigrated {
        /// Which schema set is missing (`"the outbox"`, `"the inbox"`).
        what: &'static str,
        /// The schema that was checked.
        schema: String,
        /// The migration version found (0 when none).
        found: i32,
        /// The version this library needs.
        needed: i32,
        /// The command that fixes it.
        fix: &'static str,
    },
    /// The database is at a newer migration version than this library knows.
    #[error(
        "schema {schema:?} is at migration version {found} of the {set} set, newer than this library's {known}; upgrade the library"
    )]
    SchemaTooNew {
        /// The schema that was checked.
        schema: String,
        /// The migration set.
        set: &'static str,
        /// The version found.
        found: i32,
        /// The newest version this library knows.
        known: i32,
    },
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
        /// The configured limit ([`crate::IdempotencyConfig::max_response_bytes`]).
        limit: usize,
    },
    /// The handle's [`crate::Ordering`] names an aggregate type the
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
    /// The database returned an error.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl Error {
    /// True when retrying the same operation later may succeed (connection
    /// loss, serialisation failure, deadlock, pool timeout).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => is_transient_db(e),
            _ => false,
        }
    }

    /// True when the error is a unique-constraint violation.
    pub fn is_unique_violation(&self) -> bool {
        matches!(self, Error::Database(sqlx::Error::Database(e)) if e.is_unique_violation())
    }
}

/// Whether a sqlx error is worth retrying.
pub fn is_transient_db(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // serialization_failure, deadlock_detected, admin_shutdown,
            // crash_shutdown, cannot_connect_now, lock_not_available
            Some("40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03")
        ),
        _ => false,
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
