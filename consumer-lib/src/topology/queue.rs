//! One consumer queue bound to the exchange: [`TopologyConfig`] and
//! [`declare_topology`].

use std::time::Duration;

use lapin::Connection;
use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;
use outbox::redact::SecretUrl;

use super::connect::at_any_node;
use super::declare::{declare_source_exchange, declare_work_queue};
use super::{DEFAULT_DELIVERY_LIMIT, QueueArgs, QueueType};
use crate::error::{Result, bounded};

/// What [`declare_topology`] declares.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TopologyConfig {
    /// The consumer's queue (durable).
    pub queue: String,
    /// The exchange the relay publishes to (durable topic exchange).
    pub exchange: String,
    /// Binding key of the queue (topic pattern such as `order.*`).
    pub binding_key: String,
    /// Type of the work, retry and dead-letter queues. Default
    /// [`QueueType::Quorum`]. [`ConsumerConfig::queue_type`](crate::ConsumerConfig::queue_type)
    /// must say the same.
    pub queue_type: QueueType,
    /// Quorum queues: how many times a message may come back unacked
    /// before the broker moves it to `<queue>.dlq` (it is delivered at most
    /// `delivery_limit + 1` times). Every unacked delivery a consumer holds
    /// when its channel closes comes back and counts, prefetched ones
    /// included, and in RabbitMQ 3.x a graceful stop too: a message that
    /// crashes the consumer takes the rest of its prefetch window to the
    /// DLQ with it after this many crashes (replay them; the inbox keeps
    /// them from applying twice). The consumer's own retries do not count
    /// (each is a new message). Default [`DEFAULT_DELIVERY_LIMIT`]. Ignored
    /// for classic queues.
    pub delivery_limit: u32,
    /// Most messages the work queue holds; publishes beyond it are refused
    /// (`x-overflow=reject-publish`): the relay counts a failed attempt and
    /// retries with backoff, and after its `max_attempts` moves the event
    /// to the outbox's dead letters (`outbox-relay dead-letters replay`),
    /// so size it for the longest consumer outage. RabbitMQ 3.10's quorum
    /// queues admit dead-lettered retries past the bound. `None` (default):
    /// no bound.
    pub max_length: Option<u32>,
    /// Bound on each broker round trip. Default 10 s.
    pub timeout: Duration,
}

impl TopologyConfig {
    /// Queue `queue` bound to `exchange` with `binding_key`.
    pub fn new(
        queue: impl Into<String>,
        exchange: impl Into<String>,
        binding_key: impl Into<String>,
    ) -> Self {
        Self {
            queue: queue.into(),
            exchange: exchange.into(),
            binding_key: binding_key.into(),
            queue_type: QueueType::default(),
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            max_length: None,
            timeout: Duration::from_secs(10),
        }
    }

    fn queues(&self) -> QueueArgs {
        QueueArgs {
            queue_type: self.queue_type,
            delivery_limit: self.delivery_limit,
            max_length: self.max_length,
        }
    }
}

/// Declares, idempotently and in one call: the durable topic exchange, the
/// durable queue bound to it, the retry queue `<queue>.retry` (messages
/// wait there for their per-message expiration, then dead-letter back to
/// `<queue>`) and the dead-letter queue `<queue>.dlq`.
///
/// With [`QueueType::Quorum`] (the default) all three are quorum queues;
/// the work queue dead-letters a message delivered
/// [`delivery_limit`](TopologyConfig::delivery_limit) times to
/// `<queue>.dlq`, and both the work and the retry queue dead-letter
/// at-least-once (`x-dead-letter-strategy=at-least-once`,
/// `x-overflow=reject-publish`; needs every node on 3.10 or later with the
/// `stream_queue` feature flag enabled): an expired retry stays in the
/// retry queue until the work queue has confirmed it, however long the
/// work queue is missing, refuses it or has no leader.
///
/// Declaring an existing queue with other arguments or another type fails
/// with [`Error::QueueMismatch`](crate::Error::QueueMismatch), naming the argument.
pub async fn declare_topology(conn: &Connection, topology: &TopologyConfig) -> Result<()> {
    let t = topology.timeout;
    let ch = bounded("channel open", t, conn.create_channel()).await?;
    declare_source_exchange(&ch, &topology.exchange, t).await?;
    declare_work_queue(
        &ch,
        &topology.queue,
        FieldTable::default(),
        topology.queues(),
        t,
    )
    .await?;
    bounded(
        "queue.bind",
        t,
        ch.queue_bind(
            topology.queue.as_str().into(),
            topology.exchange.as_str().into(),
            topology.binding_key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let _ = tokio::time::timeout(t, ch.close(200, "OK".into())).await;
    Ok(())
}

/// [`declare_topology`] on a connection of its own to the broker at
/// `amqp_url`, or to the first node of a cluster that answers: the same
/// URL list as [`ConsumerConfig::amqp_url`](crate::ConsumerConfig::amqp_url)
/// (URLs separated by commas, a comma in a password written `%2C`),
/// tried in order as the consumer tries them. Each connect and each round
/// trip is bounded by [`TopologyConfig::timeout`]; the connection is closed
/// before it returns.
///
/// A node that fails during the declaration (it is idempotent) costs one
/// more attempt on the next node, at most one per URL. A malformed URL is
/// [`Error::Config`](crate::Error::Config), which never quotes it; a refused login or a missing
/// virtual host on every node, [`Error::Broker`](crate::Error::Broker) that is not
/// [transient](crate::Error::is_transient).
///
/// ```no_run
/// use outbox_consumer::{Consumer, ConsumerConfig, TopologyConfig};
/// # async fn demo(pool: sqlx::PgPool, handler: impl outbox_consumer::Handler)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// // Every node of the cluster: the consumer and the declaration fail over alike.
/// let nodes = "amqp://app:secret@rabbit-1:5672/%2f,amqp://app:secret@rabbit-2:5672/%2f";
/// let topology = TopologyConfig::new("stock.orders", "outbox.events", "order.#");
/// outbox_consumer::declare_topology_at(nodes, &topology).await?;
/// let consumer = Consumer::new(ConsumerConfig::new(nodes, "stock.orders", "stock"), pool, handler)?;
/// # Ok(()) }
/// ```
pub async fn declare_topology_at(
    amqp_url: impl Into<SecretUrl>,
    topology: &TopologyConfig,
) -> Result<()> {
    at_any_node(&amqp_url.into(), topology.timeout, async |conn| {
        declare_topology(conn, topology).await
    })
    .await
}
