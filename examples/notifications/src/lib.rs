//! Example consumer: the notifications service, a second subscriber of
//! `OrderPlaced`. It records one notification row per order through
//! `outbox-consumer` under its own consumer name and queue, so its dedup
//! state is independent of every other subscriber's: a fan-out delivers
//! each event to each queue, and each service applies it once.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/notifications").await?;
//! let notes = notifications::Notifications::setup(&pool, "public").await?;
//! let queue = notifications::DEFAULT_QUEUE;
//! notifications::declare_queue(amqp, queue, "outbox.events", "order.#").await?;
//! let consumer = notifications::consumer(amqp, queue, "public", pool, notes)?;
//! consumer.run(tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod notes;

use outbox_consumer::{Consumer, ConsumerConfig, TopologyConfig};
use sqlx::PgPool;

pub use crate::notes::Notifications;

/// The consumer name: the inbox keeps this service's dedup state under it.
pub const CONSUMER_NAME: &str = "notifications";
/// The queue this service consumes unless told otherwise.
pub const DEFAULT_QUEUE: &str = "notifications.orders";

/// A dedup consumer of `queue` recording [`Notifications`], with its inbox
/// in `schema`.
pub fn consumer(
    amqp_url: &str,
    queue: &str,
    schema: &str,
    pool: PgPool,
    notes: Notifications,
) -> outbox_consumer::Result<Consumer> {
    let mut config = ConsumerConfig::new(amqp_url, queue, CONSUMER_NAME);
    config.schema = schema.to_string();
    Consumer::new(config, pool, notes)
}

/// Declares `queue` (durable, with its retry queue and DLQ) bound to the
/// relay's topic `exchange` with `binding_key` (e.g. `order.#`). Idempotent.
/// `amqp_url` is the consumer's: one broker, or every node of a cluster
/// separated by commas (the first that answers declares).
pub async fn declare_queue(
    amqp_url: &str,
    queue: &str,
    exchange: &str,
    binding_key: &str,
) -> outbox_consumer::Result<()> {
    let topology = TopologyConfig::new(queue, exchange, binding_key);
    outbox_consumer::declare_topology_at(amqp_url, &topology).await
}
