//! Transactional outbox for PostgreSQL: write your business state and the
//! events about it in **one transaction**; the relay (`outbox-relay`)
//! publishes the events to RabbitMQ at least once, and consumers built with
//! `consumer-lib` apply each event's effect exactly once.
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
//! Per-aggregate ordering is opt-in and a property of the data: once an
//! aggregate type is ordered in the database ([`set_ordered`] or
//! `outbox-relay ordering add order`), every event of an `order` aggregate,
//! whoever writes it, gets the aggregate's next sequence number in commit
//! order, and relays and ordered consumers keep that order
//! ([`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md)). `OutboxConfig::ordering` makes a service check at
//! start-up that the types it relies on are ordered.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod event;
mod idempotency;
mod migrate;
mod ordered_types;
mod outbox;
#[cfg(feature = "signal")]
mod signal;
mod wakeup;
pub mod wire;

use sqlx::PgPool;

pub use crate::error::{Error, MigrateError, Result};
pub use crate::event::{EVENT_ID_NAMESPACE, NewEvent};
pub use crate::idempotency::*;
pub use crate::ordered_types::{ALL_TYPES, ordered_types, set_ordered};
pub use crate::outbox::{DEFAULT_MAX_PAYLOAD_BYTES, Ordering, Outbox, OutboxConfig};
#[cfg(feature = "signal")]
#[cfg_attr(docsrs, doc(cfg(feature = "signal")))]
pub use crate::signal::shutdown_signal;
pub use crate::wakeup::Wakeup;
/// Passwords in URLs never reach a log line, an error or `--help`: the
/// helpers the toolkit's own binaries use, for yours.
pub use outbox_core::redact;
pub use outbox_core::{Ident, wakeup_channel};

/// Applies the producer's migrations (outbox, dead letters, idempotency
/// keys) to `schema`, creating it if needed. Safe to run concurrently and
/// repeatedly: re-running is a no-op. Returns the versions applied.
pub async fn migrate(pool: &PgPool, schema: &str) -> Result<Vec<i32>> {
    let schema = Ident::new("schema", schema)?;
    Ok(outbox_core::migrate::apply(pool, &migrate::PRODUCER, &schema).await?)
}

/// Fails with [`MigrateError::NotMigrated`] unless `schema` holds every
/// producer migration this library knows, and with
/// [`MigrateError::SchemaTooNew`] if it holds newer ones. The relay calls it at start-up; [`Outbox::new`] makes the same check.
pub async fn check_migrated(pool: &PgPool, schema: &str) -> Result<()> {
    let schema = Ident::new("schema", schema)?;
    Ok(outbox_core::migrate::ensure_migrated(pool, &migrate::PRODUCER, &schema).await?)
}
