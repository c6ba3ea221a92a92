//! Dedup consumer for the transactional outbox: exactly-once **effects**
//! from at-least-once RabbitMQ delivery.
//!
//! Each delivery's event id is recorded in the inbox table **in the same
//! Postgres transaction** as the handler's effect; the message is acked only
//! after that transaction commits. A redelivery or duplicate finds its id
//! in the inbox and is acked without running the handler, so each effect
//! commits once per consumer name, whatever the duplicates, redeliveries
//! and crashes.
//!
//! ```no_run
//! use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome};
//! use sqlx::PgConnection;
//!
//! struct Reserve;
//!
//! impl Handler for Reserve {
//!     async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
//!         let Ok(order) = event.payload::<serde_json::Value>() else {
//!             return Outcome::reject("payload is not an order");
//!         };
//!         let r = sqlx::query("UPDATE stock SET qty = qty - 1 WHERE sku = $1")
//!             .bind(order["sku"].as_str())
//!             .execute(conn)
//!             .await;
//!         match r {
//!             Ok(_) => Outcome::Ack,
//!             // A deadlock or serialization failure: the batch runs again
//!             // at once; any other error via <queue>.retry, with backoff.
//!             Err(e) => e.into(),
//!         }
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/stock").await?;
//! outbox_consumer::migrate(&pool, "public").await?;
//! let config = ConsumerConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "stock.orders", "stock");
//! let consumer = Consumer::new(config, pool, Reserve)?;
//! // Until SIGTERM (Kubernetes, systemd, `docker stop`) or Ctrl-C, then the
//! // batch in hand is committed and acked; `run(token)` stops on your token.
//! consumer.run_until_signal().await?;
//! # Ok(()) }
//! ```
//!
//! **Ordered consumption** (opt-in, [`ConsumerConfig::sequencing`]): events
//! carrying `x-aggregate-seq` are applied per aggregate in sequence order,
//! tracked in the `inbox_sequences` table in the same transaction as their
//! effects; stale copies are acked without effect, gaps wait in the retry
//! queue. [`declare_ordered_topology`] declares the routing that keeps
//! each aggregate on one single-active-consumer queue (optionally
//! partitioned by a consistent-hash exchange).
//!
//! **Testing a handler** (feature `testing`): the `testing` module runs
//! your [`Handler`] on built events against a real test database, without
//! RabbitMQ, through this crate's own batch code (dedup, sequencing,
//! outcomes), and tells what a running consumer would have done with each
//! message ([`docs/GETTING_STARTED.md`](https://github.com/outbox-rs/outbox/blob/main/docs/GETTING_STARTED.md), "Tests").
//!
//! Contracts: [`docs/CONSUMER.md`](https://github.com/outbox-rs/outbox/blob/main/docs/CONSUMER.md) (guarantees, retries, dead letters,
//! metrics) and [`docs/INBOX_TABLE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/INBOX_TABLE.md) (the inbox table and retention).
//!
//! Words (dedup, sequencing, turn, outcome, verdict, deferral, ack) mean
//! what the [glossary](outbox#glossary-the-pipeline-and-the-words-for-it)
//! says; a batch goes `session.rs` (deliveries in, reconnects) →
//! `process/` (decode, then each delivery's disposition) → `batch/`
//! (one transaction: `inbox.rs`, `sequence/`, the handler) → `ack.rs`
//! (republish, then ack); `consumer.rs` is the handle that runs it, and
//! `pause.rs` the backoff pause both the session and the stages use.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod ack;
mod batch;
mod config;
mod consumer;
mod error;
mod event;
mod handler;
mod inbox;
mod migrate;
mod pause;
mod process;
mod retention;
mod sequence;
mod session;
mod telemetry;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod topology;
mod trace;
mod version;

use sqlx::PgPool;

pub use crate::config::{ConsumerConfig, DedupKey, Sequencing};
pub use crate::consumer::Consumer;
pub use crate::error::{BrokerError, Error, Result};
pub use crate::event::{Event, HEADER_DEFERRAL_COUNT, HEADER_DELIVERY_COUNT, MAX_DEDUP_KEY_BYTES};
pub use crate::handler::{BatchHandler, BatchOutcome, Conflict, Handler, Outcome};
pub use crate::retention::{
    DAYS_AHEAD, DEFAULT_RETENTION, Held, RetentionReport, RetentionTask, cleanup_inbox,
    inbox_retention,
};
pub use crate::telemetry::ConsumerStats;
pub use crate::topology::{
    DEFAULT_DELIVERY_LIMIT, MAX_PARTITIONS, OrderedTopology, QueueType, TopologyConfig,
    declare_ordered_topology, declare_ordered_topology_at, declare_topology, declare_topology_at,
};
pub use crate::trace::TraceContext;
pub use crate::version::apply_if_newer;

/// The lapin (4) whose `Connection` [`declare_topology`] and
/// [`declare_ordered_topology`] take and whose types [`Event`] exposes
/// (`BasicProperties`, `AMQPValue`): use `outbox_consumer::lapin` instead
/// of a dependency of your own, or depend on the same version.
pub use lapin;

/// The sqlx (0.9) whose types this API takes (`PgPool`, the
/// `&mut PgConnection` a [`Handler`] writes through): use
/// `outbox_consumer::sqlx` instead of a dependency of your own, or depend
/// on the same version.
pub use sqlx;

/// Applies the consumer's migrations (the inbox, version and sequence tables) to
/// `schema`, creating it if needed. Safe to run concurrently and
/// repeatedly. Returns the versions applied (empty: nothing to do).
pub async fn migrate(pool: &PgPool, schema: &str) -> Result<Vec<i32>> {
    let schema = outbox::Ident::new("schema", schema)?;
    Ok(
        outbox_core::migrate::apply(pool, &migrate::CONSUMER, &schema)
            .await
            .map_err(outbox::Error::from)?,
    )
}
