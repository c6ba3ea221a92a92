//! The relay engine behind `outbox-relay`: publishes the transactional
//! outbox to RabbitMQ **at least once**.
//!
//! It claims due events with `FOR UPDATE SKIP LOCKED` (so several relays
//! share one outbox), publishes a whole batch with publisher confirms
//! pipelined, counts an event delivered only on an `Ack` that carries no
//! returned message, and removes delivered rows in the claim's
//! transaction. Failed events are retried with exponential backoff and
//! jitter, then dead-lettered. A crash anywhere re-runs work; nothing is
//! lost, and the only duplicates are publishes whose settle did not commit.
//!
//! Ordered events (`aggregate_seq` set by the producer, [`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md))
//! are published per aggregate in sequence: relays lease the 64 partitions
//! of the aggregate key space (fair shares, handed over when a relay dies
//! or stops), claim each aggregate from its head only, and never
//! dead-letter an ordered event by themselves: a failing one blocks its own
//! aggregate until delivered or skipped by an operator.
//!
//! The public items are the engine's: [`Relay`] with its [`RelayConfig`]
//! (and [`WalCapture`]), its [`Health`], its [`Error`] (with
//! [`BrokerError`] and [`ConfigError`]), the options of the pool it runs on best
//! ([`pool_options`]), the WAL capture's set-up ([`create_wal_slot`],
//! [`drop_wal_slot`], [`recorded_wal_slot`], [`WalSetUp`]), the message an event becomes
//! ([`OutboxEvent`]) and the move of events to the dead-letter table
//! ([`dead_letter_events`], what an operator's skip does). [`Fleet`] (with
//! [`FleetConfig`], [`TenantStatus`], [`TenantHealth`]) serves many tenant
//! schemas of several databases from one process (`fleet/`: one pool,
//! LISTEN session, census and probe per database, one broker connection,
//! workers taking turns over the tenants with work); a first slice, without
//! a CLI yet. The
//! `outbox-relay` binary and the operator tools (status, dead letters,
//! blocked aggregates, the web console) are the crate `outbox-relay-ops`,
//! built on these items alone; a service embedding the relay needs only
//! this crate.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use outbox_relay::{Relay, RelayConfig};
//! // Every wait on the pool bounded, as the relay's own calls are
//! // (`RelayConfig::database_timeout`): a connection whose link went
//! // silent is dropped, never waited for.
//! let pool = outbox_relay::pool_options(Duration::from_secs(10))
//!     .max_connections(5)
//!     .connect("postgres://app@127.0.0.1/shop")
//!     .await?;
//! let mut config = RelayConfig::default();
//! config.amqp_url = "amqp://relay:secret@127.0.0.1:5672/%2f".into();
//! config.batch_size = 1000;
//! let relay = Relay::new(pool, config).await?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! tokio::spawn({
//!     let shutdown = shutdown.clone();
//!     async move {
//!         outbox::shutdown_signal().await; // SIGTERM or Ctrl-C
//!         shutdown.cancel();
//!     }
//! });
//! relay.run(shutdown).await?;
//! # Ok(()) }
//! ```
//!
//! With [`RelayConfig::wal`] ([`WalCapture`]) the relay also streams the
//! events producers wrote to the write-ahead log (`outbox::Capture::Wal`)
//! from the schema's logical replication slot: one relay reads it, others
//! wait as standbys; events it cannot deliver go to the outbox table and
//! are retried there; the slot is confirmed only past events delivered or
//! so recorded ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md), code in `wal/`).
//!
//! Words (claim, chain, lease, receipt, settle, held back, dead letter)
//! mean what the [glossary](outbox#glossary-the-pipeline-and-the-words-for-it)
//! says; the files follow the stages (`docs/ARCHITECTURE.md` draws them):
//! `relay.rs` (builds the stages), `supervisor.rs` (the broker session and
//! its workers), `maintenance.rs` (leases, stats, the claims' floor, the
//! archive's days: `archive.rs`), `broker.rs`
//! (connections with failover, the broker's blocks), `db.rs` (every
//! database call bounded), `worker.rs` (one batch), `claim/`
//! (ordered and unordered events, claimed in one statement), `lease.rs`,
//! `publish/`, `settle.rs`, `quarantine.rs`, `stats.rs`, `wal/` (the log's
//! reader and its set-up);
//! each stage's SQL is in `.sql` files beside it (`sql.rs`).
#![cfg_attr(docsrs, feature(doc_cfg))]

mod archive;
mod broker;
mod claim;
mod config;
mod db;
mod error;
#[cfg(feature = "fault-injection")]
mod fault;
mod fleet;
mod health;
mod lease;
mod maintenance;
mod message;
mod mutex;
mod publish;
mod quarantine;
mod relay;
mod settle;
mod sql;
mod stages;
mod stats;
mod supervisor;
mod wakeup;
mod wal;
mod worker;

pub use crate::config::{RelayConfig, WalCapture};
pub use crate::db::pool_options;
pub use crate::error::{BrokerError, ConfigError, Error, Result};
/// Testing only (feature `fault-injection`): the event types that make the
/// relay fail on purpose (`fault.rs`).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use crate::fault::{FAULT_CHANNEL_EVENT_TYPE, FAULT_PANIC_EVENT_TYPE};
pub use crate::fleet::{
    FLEET_SCHEMA, Fleet, FleetConfig, TenantHealth, TenantStatus, migrate_fleet,
};
pub use crate::health::Health;
pub use crate::message::OutboxEvent;
pub use crate::relay::Relay;
pub use crate::settle::dead_letter_events;
pub use crate::wal::{WalSetUp, create_wal_slot, drop_wal_slot, recorded_wal_slot};

/// Test seams (feature `testing`, this workspace's tests and bench): one
/// batch at a time on a session of its own.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use crate::{
    settle::Settled,
    worker::{BatchReport, WorkerSession},
};
