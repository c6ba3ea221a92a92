//! Transactional outbox for PostgreSQL: write your business state and the
//! events about it in **one transaction**; the relay (`outbox-relay`)
//! publishes the events to RabbitMQ at least once, and consumers built with
//! `outbox-consumer` apply each event's effect exactly once.
//!
//! ```no_run
//! use outbox::{NewEvent, Outbox, OutboxConfig};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/shop").await?;
//! outbox::migrate(&pool, "public").await?; // or: outbox-relay migrate
//! let outbox = Outbox::new(&pool, OutboxConfig::default()).await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1")
//!     .bind("A-1")
//!     .execute(&mut *tx)
//!     .await?;
//! outbox
//!     .enqueue(&mut *tx, NewEvent::new("order", "o-42", "OrderPlaced", &serde_json::json!({"sku": "A-1"}))?)
//!     .await?;
//! outbox.commit(tx).await?; // both rows or neither; then the relay is woken
//! # Ok(()) }
//! ```
//!
//! The outbox table is a public contract ([`docs/OUTBOX_TABLE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/OUTBOX_TABLE.md)): services
//! in other languages may insert into it directly.
//!
//! Events go to the outbox table by default. With
//! [`OutboxConfig::capture`] set to [`Capture::Wal`] they are written as
//! transactional logical decoding messages to PostgreSQL's write-ahead log
//! instead (no row, no vacuum; `outbox-relay run --capture wal` streams
//! them from a replication slot), with the same API, contract and
//! guarantees ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).
//!
//! Per-aggregate ordering is opt-in and a property of the data: once an
//! aggregate type is ordered in the database ([`set_ordered`] or
//! `outbox-relay ordering add order`), every event of an `order` aggregate,
//! whoever writes it, gets the aggregate's next sequence number in commit
//! order, and relays and ordered consumers keep that order
//! ([`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md)). `OutboxConfig::ordering` ([`OrderedAggregates`]) makes a
//! service check at start-up that the types it relies on are ordered.
//!
//! A service from zero (dependencies, producer, relay, consumer, tests):
//! [`docs/GETTING_STARTED.md`](https://github.com/outbox-rs/outbox/blob/main/docs/GETTING_STARTED.md).
//! Its tests use the `testing` module (feature `testing`): a fresh schema
//! per test, and the events a transaction enqueued.
//!
//! ## Glossary: the pipeline and the words for it
//!
//! An event goes enqueue → claim → publish → settle → consume → dedup →
//! effect → ack. Each word below names one thing across the toolkit's
//! crates (the file that holds the stage in brackets).
//!
//! | word | meaning |
//! |---|---|
//! | **enqueue** | writing an event row in the caller's transaction, [`Outbox::enqueue`] (`outbox-lib/src/outbox/`) |
//! | **ordered aggregates** | the aggregate types the database numbers per aggregate (`aggregate_seq`), set with [`set_ordered`]; [`OrderedAggregates`] is what a handle checks at start-up |
//! | **claim** | a relay locking a batch of due rows with `FOR UPDATE SKIP LOCKED` (`relay/src/claim/`); an HTTP request *claims its key* too, a row in `idempotency_keys` ([`idempotency::Claim`]); the consumer's inbox insert is called dedup, never a claim |
//! | **batch** | the relay's: the rows one claim takes, published and settled in one database transaction (`--batch-size`); the consumer's: the deliveries it runs in one database transaction (`ConsumerConfig::batch_size`). The two are unrelated in size |
//! | **chain** | an aggregate's share of an ordered claim: its head and the consecutive events behind it, published in sequence |
//! | **lease**, **partition** | ordered aggregates hash to 64 partitions; a relay publishes the partitions it holds a lease on (`relay/src/lease.rs`) |
//! | **publish** | sending a claimed batch with publisher confirms (`relay/src/publish/`) |
//! | **receipt** | what became of one publish: delivered, nacked, returned, timed out, … (`relay/src/publish/receipt.rs`) |
//! | **settle** | the relay recording the receipts in the database: delivered rows deleted (or archived), failures rescheduled with backoff, hopeless ones dead-lettered (`relay/src/settle.rs`) |
//! | **held back** | an ordered event not sent (relay) or not applied (consumer) because an earlier event of its aggregate failed first |
//! | **dead letter** | an event set aside for an operator: a row in `outbox_dead_letters` (relay), a message in `<queue>.dlq` (consumer) |
//! | **consume** | a consumer taking a batch of deliveries (`consumer-lib/src/session.rs`) and running it in one transaction: its *pipeline* (`consumer-lib/src/process/`: decode, commit, dispositions, ack) around the batch transaction (`consumer-lib/src/batch/`); "process" means an operating-system process everywhere else |
//! | **dedup** | the inbox insert that tells a fresh event from a duplicate (`consumer-lib/src/inbox.rs`) |
//! | **sequencing** | a consumer applying sequenced events per aggregate in order (`outbox_consumer::Sequencing`) |
//! | **turn** | where a sequenced event stands: its turn (next in its aggregate), stale (applied before), a gap (an earlier one missing) or held back (`consumer-lib/src/sequence/`) |
//! | **effect**, **outcome** | the handler's work in the transaction, and its answer about one event: `Ack`, `Retry` or `Reject` (`outbox_consumer::Outcome`) |
//! | **verdict** | what the batch transaction concluded for one delivery: duplicate, stale, deferred, or handled with an outcome |
//! | **deferral** | a sequenced event sent back through the retry queue to wait for its turn; counted apart from retries |
//! | **ack** | after the commit, each delivery's *disposition* carried out: retries, deferrals and dead letters republished with confirms, then the deliveries acked (`consumer-lib/src/ack.rs`) |
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod event;
pub mod idempotency;
mod migrate;
mod ordered_types;
mod outbox;
#[cfg(feature = "signal")]
mod signal;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod wakeup;

use sqlx::PgPool;

pub use crate::error::{Error, MigrateError, Result};
pub use crate::event::{EVENT_ID_NAMESPACE, NewEvent};
pub use crate::ordered_types::{ALL_TYPES, OrderedAggregates, ordered_types, set_ordered};
pub use crate::outbox::{Capture, DEFAULT_MAX_PAYLOAD_BYTES, Outbox, OutboxConfig};
#[cfg(feature = "signal")]
#[cfg_attr(docsrs, doc(cfg(feature = "signal")))]
pub use crate::signal::shutdown_signal;
pub use crate::wakeup::Wakeup;
pub use outbox_core::migrate::{SchemaState, SchemaVersion};
/// Passwords in URLs never reach a log line, an error or `--help`: the
/// helpers the toolkit's own binaries use, for yours.
pub use outbox_core::redact;
/// Reading and checking the URLs of a setting (one, or a comma-separated
/// list of broker nodes) without quoting them.
pub use outbox_core::urls;
/// The AMQP message contract shared by the relay and the consumer
/// ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md)).
pub use outbox_core::wire;
pub use outbox_core::{Ident, wakeup_channel, wal_message_prefix, wal_slot_name};

/// The sqlx (0.9) whose types this API takes (`PgPool`, `&mut PgConnection`,
/// `Transaction`): use `outbox::sqlx` instead of a dependency of your own,
/// or depend on the same version.
pub use sqlx;

/// The axum (0.8) the Idempotency-Key integration plugs into
/// ([`idempotency`]): use `outbox::axum` instead of a dependency of your
/// own, or depend on the same version.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use axum;

/// Applies the producer's migrations (outbox, dead letters, idempotency
/// keys) to `schema`, creating it if needed. Safe to run concurrently and
/// repeatedly: re-running is a no-op. Returns the versions applied.
pub async fn migrate(pool: &PgPool, schema: &str) -> Result<Vec<i32>> {
    let schema = Ident::new("schema", schema)?;
    Ok(outbox_core::migrate::apply(pool, &migrate::PRODUCER, &schema).await?)
}

/// Every schema of the database that holds the outbox (at any producer
/// migration version), its name `LIKE` `pattern` when one is given
/// (`"tenant_%"`), in name order, each with where it stands against this
/// release's migrations ([`SchemaState`]): current, behind (run
/// [`migrate`]), too new, or unreadable by this role. One round trip per
/// 500 schemas: what `outbox-relay schemas` and `migrate --all-schemas`
/// look at to find a database's tenants.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> outbox::Result<()> {
/// for s in outbox::census(&pool, Some("tenant_%")).await? {
///     if !matches!(s.state, outbox::SchemaState::Current(_)) {
///         println!("{}: {}", s.schema, s.state);
///     }
/// }
/// # Ok(()) }
/// ```
pub async fn census(pool: &PgPool, pattern: Option<&str>) -> Result<Vec<SchemaVersion>> {
    Ok(outbox_core::migrate::census(pool, &migrate::PRODUCER, pattern).await?)
}

/// Fails with [`MigrateError::NotMigrated`] unless `schema` holds every
/// producer migration this library knows, and with
/// [`MigrateError::SchemaTooNew`] if it holds newer ones. The relay calls it at start-up; [`Outbox::new`] makes the same check.
pub async fn check_migrated(pool: &PgPool, schema: &str) -> Result<()> {
    let schema = Ident::new("schema", schema)?;
    Ok(outbox_core::migrate::ensure_migrated(pool, &migrate::PRODUCER, &schema).await?)
}
