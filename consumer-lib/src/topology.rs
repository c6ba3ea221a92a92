use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ErrorKind, ExchangeKind};
use outbox::redact::SecretUrl;
use outbox::wire;

use crate::error::{Error, Result, bounded};

/// The type of the queues the topology helpers declare ([`docs/OPERATIONS.md`](https://github.com/outbox-rs/outbox/blob/main/docs/OPERATIONS.md),
/// "Production RabbitMQ").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// RabbitMQ's replicated queue (Raft over the cluster's nodes; one
    /// node is a cluster of one). The default: it survives the loss of a
    /// minority of nodes, counts redeliveries (`x-delivery-count`) and
    /// enforces a delivery limit, and it is the only type whose
    /// dead-lettering is confirmed (`x-dead-letter-strategy=at-least-once`),
    /// which is what makes the retry path loss-free.
    #[default]
    Quorum,
    /// A classic queue, declared exactly as versions before quorum support
    /// did (no arguments besides single active consumer): lives on one
    /// node; an expired retry dead-letters back to the work queue without
    /// confirms, so it is lost when the work queue is full or unavailable
    /// at that moment. For brokers older than 3.10 and existing classic
    /// queues (a queue cannot change type in place).
    Classic,
}

/// RabbitMQ 4's default delivery limit of quorum queues, ours for every
/// version.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

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

/// The queue settings shared by both topologies.
#[derive(Debug, Clone, Copy)]
struct QueueArgs {
    queue_type: QueueType,
    delivery_limit: u32,
    max_length: Option<u32>,
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
/// with [`Error::QueueMismatch`], naming the argument.
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
/// [`Error::Config`], which never quotes it; a refused login or a missing
/// virtual host on every node, [`Error::Broker`] that is not
/// [transient](Error::is_transient).
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
    /// (as [`TopologyConfig::queue_type`]).
    pub queue_type: QueueType,
    /// As [`TopologyConfig::delivery_limit`].
    pub delivery_limit: u32,
    /// As [`TopologyConfig::max_length`], per partition queue.
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
/// [`declare_topology`] declares them. Single active consumer makes the
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
/// node of `amqp_url` that answers, as [`declare_topology_at`] does (the
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

/// Connects to the first node of `amqp_url` that answers
/// ([`outbox_core::amqp::connect_any`], as the consumer's sessions do),
/// runs `declare` on the connection and closes it. A transient failure
/// moves on to the next node: at most one attempt per URL.
async fn at_any_node<T>(
    amqp_url: &SecretUrl,
    timeout: Duration,
    declare: impl AsyncFn(&Connection) -> Result<T>,
) -> Result<T> {
    let urls = broker_urls(amqp_url)?;
    let (mut start, mut attempts_left) = (0, urls.len());
    loop {
        let props =
            ConnectionProperties::default().with_connection_name("outbox-consumer topology".into());
        let (conn, i) = outbox_core::amqp::connect_any(&urls, start, timeout, props).await?;
        let declared = declare(&conn).await;
        let _ = tokio::time::timeout(timeout, conn.close(200, "topology declared".into())).await;
        attempts_left -= 1;
        match declared {
            Err(e) if e.is_transient() && attempts_left > 0 => {
                let node = outbox::redact::host_port(urls[i]);
                tracing::debug!(broker = %node, error = %e, "declaring the topology failed; trying the next node");
                start = i + 1;
            }
            done => return done,
        }
    }
}

/// The URLs of `amqp_url`, each checked before anything connects with it:
/// lapin's own error for a malformed one would quote it, password and all.
fn broker_urls(amqp_url: &SecretUrl) -> Result<Vec<&str>> {
    let list = amqp_url.expose();
    outbox::redact::check_urls(list, "AMQP URL", &["amqp", "amqps"]).map_err(Error::Config)?;
    let urls = outbox::redact::split_urls(list);
    if urls
        .iter()
        .any(|u| u.parse::<lapin::uri::AMQPUri>().is_err())
    {
        return Err(Error::Config(
            "AMQP URL is malformed (its user, host, vhost or query parameters); the value is not shown: it may hold a password".to_owned(),
        ));
    }
    Ok(urls)
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
        Error::Broker { source, .. }
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

/// The durable topic exchange the relay publishes to.
async fn declare_source_exchange(ch: &Channel, exchange: &str, t: Duration) -> Result<()> {
    bounded(
        "exchange.declare",
        t,
        ch.exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
}

/// A durable work queue with `extra` arguments, and its retry queue and
/// DLQ.
async fn declare_work_queue(
    ch: &Channel,
    queue: &str,
    extra: FieldTable,
    q: QueueArgs,
    t: Duration,
) -> Result<()> {
    let mut args = extra;
    if q.queue_type == QueueType::Quorum {
        quorum(&mut args);
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(q.delivery_limit.into()),
        );
        dead_letter_to(&mut args, &format!("{queue}.dlq"));
    }
    if let Some(max) = q.max_length {
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(max.into()));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
    }
    declare_queue(ch, queue, args, "queue.declare", t).await?;
    declare_retry_queues(ch, queue, q.queue_type, t).await
}

/// `x-queue-type=quorum`.
fn quorum(args: &mut FieldTable) {
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
}

/// Dead-letters to `target` through the default exchange (which routes by
/// queue name), confirmed: the broker keeps a message until the target has
/// accepted it (quorum queues only; needs `x-overflow=reject-publish`).
fn dead_letter_to(args: &mut FieldTable, target: &str) {
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(target.into()),
    );
    args.insert(
        "x-dead-letter-strategy".into(),
        AMQPValue::LongString("at-least-once".into()),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
}

/// Declares `<queue>.retry` and `<queue>.dlq`.
pub(crate) async fn declare_retry_queues(
    ch: &Channel,
    queue: &str,
    queue_type: QueueType,
    t: Duration,
) -> Result<()> {
    let mut retry_args = FieldTable::default();
    match queue_type {
        QueueType::Quorum => {
            quorum(&mut retry_args);
            dead_letter_to(&mut retry_args, queue);
        }
        QueueType::Classic => {
            // The default exchange routes by queue name: an expired retry
            // goes straight back to the work queue (unconfirmed).
            retry_args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            retry_args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(queue.into()),
            );
        }
    }
    declare_queue(
        ch,
        &format!("{queue}.retry"),
        retry_args,
        "queue.declare (retry)",
        t,
    )
    .await?;
    let mut dlq_args = FieldTable::default();
    if queue_type == QueueType::Quorum {
        quorum(&mut dlq_args);
    }
    declare_queue(
        ch,
        &format!("{queue}.dlq"),
        dlq_args,
        "queue.declare (dlq)",
        t,
    )
    .await
}

/// A durable queue; an existing one with other arguments is
/// [`Error::QueueMismatch`].
async fn declare_queue(
    ch: &Channel,
    queue: &str,
    args: FieldTable,
    what: &'static str,
    t: Duration,
) -> Result<()> {
    bounded(
        what,
        t,
        ch.queue_declare(queue.into(), QueueDeclareOptions::durable(), args),
    )
    .await
    .map(drop)
    .map_err(|e| mismatch(e, queue))
}

/// RabbitMQ answers a declaration at odds with the existing queue with
/// 406 `PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue
/// 'q' in vhost '/': received ... but current value is ...`.
fn mismatch(e: Error, queue: &str) -> Error {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match e {
        Error::Broker { source, .. }
            if matches!(source.kind(), ErrorKind::ProtocolError(amqp)
                if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)) =>
        {
            let detail = match source.kind() {
                ErrorKind::ProtocolError(amqp) => {
                    let text = amqp.get_message().as_str();
                    text.split_once(" - ").map_or(text, |(_, d)| d).to_owned()
                }
                _ => String::new(),
            };
            Error::QueueMismatch {
                queue: queue.to_owned(),
                detail,
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
    fn a_conflicting_declaration_names_the_queue_and_the_argument() {
        let refused = |kind, text: &str| Error::Broker {
            what: "queue.declare",
            source: ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into(),
        };
        let e = mismatch(
            refused(
                AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::PRECONDITIONFAILED),
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'stock' in vhost '/': received the value 'quorum' of type 'longstr' but current value is 'classic' of type 'longstr'",
            ),
            "stock",
        );
        assert!(!e.is_transient());
        let text = e.to_string();
        assert!(
            text.contains("\"stock\"") && text.contains("'x-queue-type'"),
            "{text}"
        );
        assert!(text.contains("QueueType::Classic"), "{text}");
        // Anything else stays what it is.
        let other = mismatch(
            refused(
                AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED),
                "NOT_ALLOWED - vhost",
            ),
            "stock",
        );
        assert!(matches!(other, Error::Broker { .. }));
    }

    #[test]
    fn an_unknown_exchange_type_names_the_plugin() {
        let refused = |text: &str| Error::Broker {
            what: "exchange.declare (x-consistent-hash)",
            source: ErrorKind::ProtocolError(AMQPError::new(
                AMQPErrorKind::Hard(AMQPHardError::COMMANDINVALID),
                text.into(),
            ))
            .into(),
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
        assert!(matches!(other, Error::Broker { .. }));
    }
}
