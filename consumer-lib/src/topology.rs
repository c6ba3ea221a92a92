use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

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
            timeout: Duration::from_secs(10),
        }
    }
}

/// Declares, idempotently and in one call: the durable topic exchange, the
/// durable queue bound to it, the retry queue `<queue>.retry` (messages
/// wait there for their per-message expiration, then dead-letter back to
/// `<queue>`) and the dead-letter queue `<queue>.dlq`.
///
/// Declaring an existing queue with different arguments fails
/// (`PRECONDITION_FAILED`); the error says which.
pub async fn declare_topology(conn: &Connection, topology: &TopologyConfig) -> Result<()> {
    let t = topology.timeout;
    let ch = bounded("channel open", t, conn.create_channel()).await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(
        "exchange.declare",
        t,
        ch.exchange_declare(
            topology.exchange.as_str().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        ),
    )
    .await?;
    bounded(
        "queue.declare",
        t,
        ch.queue_declare(
            topology.queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        ),
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
    declare_retry_queues(&ch, &topology.queue, t).await?;
    let _ = tokio::time::timeout(t, ch.close(200, "OK".into())).await;
    Ok(())
}

/// Declares `<queue>.retry` and `<queue>.dlq`.
pub(crate) async fn declare_retry_queues(ch: &Channel, queue: &str, t: Duration) -> Result<()> {
    let mut retry_args = FieldTable::default();
    // The default exchange routes by queue name: an expired retry goes
    // straight back to the work queue.
    retry_args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    retry_args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(queue.into()),
    );
    bounded(
        "queue.declare (retry)",
        t,
        ch.queue_declare(
            format!("{queue}.retry").into(),
            QueueDeclareOptions::durable(),
            retry_args,
        ),
    )
    .await?;
    bounded(
        "queue.declare (dlq)",
        t,
        ch.queue_declare(
            format!("{queue}.dlq").into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok(())
}
