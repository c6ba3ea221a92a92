//! The settings of an [`Outbox`] handle.

use crate::ordered_types::OrderedAggregates;
use crate::wakeup::Wakeup;

#[cfg(doc)]
use super::Outbox;

/// Default payload limit: 1 MiB, far below RabbitMQ's maximum message size
/// (128 MiB by default) and small enough that one event never stalls a
/// relay batch.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// How an [`Outbox`] writes events: which capture path the relay reads
/// them from ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).
/// The AMQP message, the consumer and every guarantee are the same for both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Capture {
    /// A row in the outbox table (default): any relay mode publishes it,
    /// and services in any language can insert rows directly.
    #[default]
    Table,
    /// A transactional logical decoding message in the write-ahead log
    /// (SQL function `outbox_emit`): no table row, no index, no vacuum;
    /// decoded only if the transaction commits, in commit order. Needs
    /// `wal_level = logical` and the schema's replication slot
    /// (`outbox-relay migrate --capture wal`), which [`Outbox::new`]
    /// checks, and a relay running `--capture wal`. An id written twice is
    /// published twice (no primary key to absorb it; consumers dedup).
    Wal,
}

/// Settings of an [`Outbox`] handle.
///
/// Like every configuration of the toolkit: start from
/// [`OutboxConfig::default()`], assign the fields you change; [`Outbox::new`]
/// validates the result.
///
/// ```
/// use outbox::{OrderedAggregates, OutboxConfig};
/// let mut config = OutboxConfig::default();
/// config.schema = "shop".into();
/// config.ordering = OrderedAggregates::types(["order"]);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxConfig {
    /// The schema holding the outbox tables (default `public`). Validated by
    /// [`Outbox::new`]: `[a-z_][a-z0-9_]*`, at most 56 characters.
    pub schema: String,
    /// Largest accepted payload, in bytes of JSON text (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`]).
    pub max_payload_bytes: usize,
    /// How relays learn of new events (default [`Wakeup::AfterCommit`]).
    pub wakeup: Wakeup,
    /// Aggregate types this service relies on being ordered (default
    /// [`OrderedAggregates::None`]: whatever the database says). Ordering is a
    /// property of the data, not of a handle: the database numbers every
    /// writer's events of an ordered type ([`crate::set_ordered`],
    /// `outbox-relay ordering add`), with or without this setting;
    /// [`Outbox::new`] checks that it orders the types named here and
    /// fails with [`crate::Error::OrderingNotRegistered`] otherwise. An
    /// ordered event takes the next number of its aggregate
    /// (`outbox_sequences`), holding that row's lock until the transaction
    /// ends: transactions writing events of the same aggregate commit one
    /// after the other. See [`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md).
    pub ordering: OrderedAggregates,
    /// Where events go (default [`Capture::Table`]).
    pub capture: Capture,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            wakeup: Wakeup::default(),
            ordering: OrderedAggregates::None,
            capture: Capture::Table,
        }
    }
}
