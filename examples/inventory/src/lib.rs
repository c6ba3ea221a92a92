//! Example consumer: the inventory service. For every `OrderPlaced` event
//! it takes the ordered quantity off the stock (`qty = qty - $n`), an
//! effect that is **not** idempotent, through `outbox-consumer`, which records
//! the event id in its inbox in the same transaction: duplicates and
//! redeliveries are acked without touching the stock. A batch's rows are
//! locked in sku order first, so instances sharing a queue never deadlock.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/inventory").await?;
//! let stock = inventory::Stock::setup(&pool, "public").await?;
//! stock.seed(&pool, "A-1", 100).await?;
//! inventory::declare_queue(amqp, inventory::DEFAULT_QUEUE, "outbox.events", "order.#").await?;
//! let consumer = inventory::consumer(amqp, inventory::DEFAULT_QUEUE, "public", pool, stock)?;
//! consumer.run(tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod stock;

use outbox_consumer::{Consumer, ConsumerConfig, TopologyConfig};
use sqlx::PgPool;

pub use crate::stock::Stock;

/// The consumer name: the inbox keeps this service's dedup state under it.
pub const CONSUMER_NAME: &str = "inventory";
/// The queue this service consumes unless told otherwise.
pub const DEFAULT_QUEUE: &str = "inventory.orders";

/// A dedup consumer of `queue` applying [`Stock`]'s effect batch by batch
/// (its rows locked in sku order, so instances sharing the queue never
/// deadlock), with its inbox in `schema`.
pub fn consumer(
    amqp_url: &str,
    queue: &str,
    schema: &str,
    pool: PgPool,
    stock: Stock,
) -> outbox_consumer::Result<Consumer> {
    let mut config = ConsumerConfig::new(amqp_url, queue, CONSUMER_NAME);
    config.schema = schema.to_string();
    Consumer::with_batch_handler(config, pool, stock)
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
