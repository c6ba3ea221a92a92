//! Declaring the broker topology a consumer reads from.
//!
//! By concept: `queue.rs` (one consumer queue bound to the exchange:
//! [`TopologyConfig`], [`declare_topology`]), `ordered.rs` (the routing of
//! ordered consumption: [`OrderedTopology`], [`declare_ordered_topology`]),
//! `declare.rs` (the exchange, work, retry and dead-letter queue
//! declarations both share) and `connect.rs` (a connection of its own, to
//! the first node that answers, for the `_at` variants).

mod connect;
mod declare;
mod ordered;
mod queue;

pub(crate) use self::connect::at_any_node;
pub(crate) use self::declare::declare_retry_queues;
pub use self::ordered::{
    MAX_PARTITIONS, OrderedTopology, declare_ordered_topology, declare_ordered_topology_at,
};
pub use self::queue::{TopologyConfig, declare_topology, declare_topology_at};

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

/// The queue settings shared by both topologies.
#[derive(Debug, Clone, Copy)]
struct QueueArgs {
    queue_type: QueueType,
    delivery_limit: u32,
    max_length: Option<u32>,
}
