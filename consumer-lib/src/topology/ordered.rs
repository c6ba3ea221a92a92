//! The routing of ordered consumption: [`OrderedTopology`] and
//! [`declare_ordered_topology`] (single-active-consumer queues, optionally
//! partitioned by a consistent-hash exchange).

use outbox_core::amqp::BrokerError;
use std::time::Duration;

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ErrorKind, ExchangeKind};
use outbox::redact::SecretUrl;
use outbox::wire;

use super::connect::at_any_node;
use super::declare::{declare_source_exchange, declare_work_queue};
use super::{DEFAULT_DELIVERY_LIMIT, QueueArgs, QueueType};
use crate::error::{Error, Result, bounded};

/// Most partitions [`declare_ordered_topology`] declares.
pub const MAX_PARTITIONS: u16 = 64;

/// What [`declare_ordered_topology`] declares: the routing scheme for
/// ordered consumption ([`docs/CONSUMER.md`](https://github.com/outbox-rs/outbox/blob/main/docs/CONSUMER.md), "Ordered consumption").
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrderedTopology {
    /// The exchange the relay publishes to (durable topic exchange).
    pub exchange: String,
    /// Binding key selecting the events to consume (topic pattern such as
    /// `order.*`).
    pub binding_key: String,
    /// Name of the queue (one partition) or the prefix of the partition
    /// queues and the name of their consistent-hash exchange.
    pub name: String,
    /// Number of partition queues, 1 to [`MAX_PARTITIONS`]. Each queue has
    /// one active consumer, so this bounds the parallelism. Changing it
    /// moves aggregates between queues: drain the queues first.
    pub partitions: u16,
    /// Type of the partition queues and their retry and dead-letter queues
    /// (as [`TopologyConfig::queue_type`](super::TopologyConfig::queue_type)).
    pub queue_type: QueueType,
    /// As [`TopologyConfig::delivery_limit`](super::TopologyConfig::delivery_limit).
    pub delivery_limit: u32,
    /// As [`TopologyConfig::max_length`](super::TopologyConfig::max_length), per partition queue.
    pub max_length: Option<u32>,
    /// Bound on each broker round trip. Default 10 s.
    pub timeout: Duration,
}

impl OrderedTopology {
    /// `partitions` queues named after `name`, fed from `exchange` with
    /// `binding_key`.
    pub fn new(
        name: impl Into<String>,
        exchange: impl Into<String>,
        binding_key: impl Into<String>,
        partitions: u16,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            binding_key: binding_key.into(),
            name: name.into(),
            partitions,
            queue_type: QueueType::default(),
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            max_length: None,
            timeout: Duration::from_secs(10),
        }
    }

    /// The queue names, in partition order: `[name]` for one partition,
    /// else `name.0` to `name.{N-1}`.
    pub fn queues(&self) -> Vec<String> {
        if self.partitions == 1 {
            vec![self.name.clone()]
        } else {
            (0..self.partitions)
                .map(|i| format!("{}.{i}", self.name))
                .collect()
        }
    }

    fn validate(&self) -> Result<()> {
        let fail = |m: String| Err(Error::Config(m));
        if !(1..=MAX_PARTITIONS).contains(&self.partitions) {
            return fail(format!(
                "partitions must be 1 to {MAX_PARTITIONS}, not {}",
                self.partitions
            ));
        }
        // Room for the partition suffix (`.63`) and a queue name that
        // leaves room for `.retry` (at most 240 bytes, see ConsumerConfig).
        if self.name.is_empty() || self.name.len() > 237 {
            return fail("the ordered topology's name must be 1 to 237 bytes".to_owned());
        }
        if self.name == self.exchange {
            return fail("the ordered topology's name must differ from its exchange".to_owned());
        }
        Ok(())
    }
}

/// Declares, idempotently, the routing scheme of ordered consumption and
/// returns its queue names; run one [`Consumer`](crate::Consumer) per
/// queue in every instance of the service.
///
/// - One partition: the durable topic `exchange`, and one durable queue
///   `name` with `x-single-active-consumer` bound to it with
///   `binding_key`.
/// - N partitions: the durable topic `exchange`; a durable
///   `x-consistent-hash` exchange `name` hashing header `x-aggregate-id`,
///   bound to `exchange` with `binding_key`; durable single-active-consumer
///   queues `name.0` to `name.{N-1}`, each bound to `name` with weight 1.
///   All events of one aggregate id land in one queue, in publish order.
///
/// Every queue gets its `.retry` and `.dlq` queues, as
/// [`declare_topology`](super::declare_topology) declares them. Single active consumer makes the
/// broker deliver each queue to one consumer at a time, failing over to
/// another instance's consumer when it goes away.
///
/// Fails with [`Error::MissingPlugin`] when the broker lacks the
/// consistent-hash exchange (the broker then closes the connection), and
/// `PRECONDITION_FAILED` when a queue or exchange exists with other
/// arguments. [`declare_ordered_topology_at`] connects by itself, to the
/// first node of a cluster that answers.
pub async fn declare_ordered_topology(
    conn: &Connection,
    topology: &OrderedTopology,
) -> Result<Vec<String>> {
    topology.validate()?;
    let t = topology.timeout;
    let queues = topology.queues();
    let ch = bounded("channel open", t, conn.create_channel()).await?;
    declare_source_exchange(&ch, &topology.exchange, t).await?;
    let mut single_active = FieldTable::default();
    single_active.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    // One partition: the queue itself takes the binding.
    let (feed, key) = if topology.partitions == 1 {
        (topology.exchange.as_str(), topology.binding_key.as_str())
    } else {
        declare_hash_exchange(&ch, topology, t).await?;
        // Weight: every queue gets an equal share of the hash ring.
        (topology.name.as_str(), "1")
    };
    for q in &queues {
        let args = QueueArgs {
            queue_type: topology.queue_type,
            delivery_limit: topology.delivery_limit,
            max_length: topology.max_length,
        };
        declare_work_queue(&ch, q, single_active.clone(), args, t).await?;
        bounded(
            "queue.bind",
            t,
            ch.queue_bind(
                q.as_str().into(),
                feed.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    let _ = tokio::time::timeout(t, ch.close(200, "OK".into())).await;
    Ok(queues)
}

/// [`declare_ordered_topology`] on a connection of its own to the first
/// node of `amqp_url` that answers, as [`declare_topology_at`](super::declare_topology_at) does (the
/// consumer's URL list, each round trip bounded by
/// [`OrderedTopology::timeout`], the connection closed afterwards).
/// Returns the queue names.
///
/// ```no_run
/// use outbox_consumer::{Consumer, ConsumerConfig, OrderedTopology, Sequencing};
/// # async fn demo(pool: sqlx::PgPool, handler: impl outbox_consumer::Handler + Clone)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// // One node, or every node of a cluster separated by commas.
/// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let topology = OrderedTopology::new("stock.orders", "outbox.events", "order.#", 4);
/// let queues = outbox_consumer::declare_ordered_topology_at(url, &topology).await?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let mut running = Vec::new();
/// for queue in queues {
///     let mut config = ConsumerConfig::new(url, queue, "stock");
///     config.sequencing = Sequencing::by_sequence();
///     let consumer = Consumer::new(config, pool.clone(), handler.clone())?;
///     let shutdown = shutdown.clone();
///     running.push(tokio::spawn(async move { consumer.run(shutdown).await }));
/// }
/// # Ok(()) }
/// ```
pub async fn declare_ordered_topology_at(
    amqp_url: impl Into<SecretUrl>,
    topology: &OrderedTopology,
) -> Result<Vec<String>> {
    topology.validate()?;
    at_any_node(&amqp_url.into(), topology.timeout, async |conn| {
        declare_ordered_topology(conn, topology).await
    })
    .await
}

/// The consistent-hash exchange `name`, fed from the source exchange.
async fn declare_hash_exchange(
    ch: &Channel,
    topology: &OrderedTopology,
    t: Duration,
) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert(
        "hash-header".into(),
        AMQPValue::LongString(wire::HEADER_AGGREGATE_ID.into()),
    );
    let declared = bounded(
        "exchange.declare (x-consistent-hash)",
        t,
        ch.exchange_declare(
            topology.name.as_str().into(),
            ExchangeKind::Custom(CONSISTENT_HASH.to_owned()),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        ),
    )
    .await;
    declared.map_err(missing_plugin)?;
    bounded(
        "exchange.bind",
        t,
        ch.exchange_bind(
            topology.name.as_str().into(),
            topology.exchange.as_str().into(),
            topology.binding_key.as_str().into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
}

const CONSISTENT_HASH: &str = "x-consistent-hash";

/// An unknown exchange type (RabbitMQ: `COMMAND_INVALID - unknown exchange
/// type` / `invalid exchange type`) means the plugin is not enabled.
fn missing_plugin(e: Error) -> Error {
    match e {
        Error::Broker(BrokerError::Failed { source, .. })
            if matches!(source.kind(), ErrorKind::ProtocolError(amqp)
                if amqp.get_message().as_str().contains("exchange type")) =>
        {
            Error::MissingPlugin {
                exchange_type: CONSISTENT_HASH,
                plugin: "rabbitmq_consistent_hash_exchange",
                source,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError};

    use super::*;

    #[test]
    fn partitions_and_names_are_checked() {
        let t = |n| OrderedTopology::new("stock.orders", "events", "order.*", n);
        assert_eq!(t(1).queues(), ["stock.orders"]);
        assert_eq!(
            t(3).queues(),
            ["stock.orders.0", "stock.orders.1", "stock.orders.2"]
        );
        assert!(t(1).validate().is_ok());
        assert!(t(MAX_PARTITIONS).validate().is_ok());
        for bad in [0, MAX_PARTITIONS + 1] {
            assert!(matches!(t(bad).validate(), Err(Error::Config(m)) if m.contains("partitions")));
        }
        let long = OrderedTopology::new("q".repeat(238), "events", "#", 2);
        assert!(matches!(long.validate(), Err(Error::Config(_))));
        let same = OrderedTopology::new("events", "events", "#", 2);
        assert!(matches!(same.validate(), Err(Error::Config(_))));
    }

    #[test]
    fn an_unknown_exchange_type_names_the_plugin() {
        let refused = |text: &str| {
            Error::Broker(BrokerError::Failed {
                what: "exchange.declare (x-consistent-hash)",
                source: ErrorKind::ProtocolError(AMQPError::new(
                    AMQPErrorKind::Hard(AMQPHardError::COMMANDINVALID),
                    text.into(),
                ))
                .into(),
            })
        };
        let e = missing_plugin(refused(
            "COMMAND_INVALID - unknown exchange type 'x-consistent-hash'",
        ));
        assert!(matches!(e, Error::MissingPlugin { .. }));
        assert!(!e.is_transient());
        assert!(
            e.to_string()
                .contains("rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"),
            "{e}"
        );
        // Other refusals stay what they are.
        let other = missing_plugin(refused(
            "PRECONDITION_FAILED - inequivalent arg 'hash-header'",
        ));
        assert!(matches!(other, Error::Broker(_)));
    }
}
