//! The producer's handle: [`Outbox`] writes events in the caller's
//! transaction.
//!
//! By concept: `config.rs` (the [`OutboxConfig`] settings and the
//! [`Capture`] path), `handle.rs` (the [`Outbox`] handle: start-up checks,
//! [`Outbox::enqueue`] and [`Outbox::enqueue_many`] (validate, then write
//! by the capture path's writer), commit, wake-up), `statements.rs` (what
//! a handle prepares at start-up), `table.rs` (`TableWriter`: rows of the
//! outbox table) and `wal.rs` (`WalWriter`: logical decoding messages in
//! the write-ahead log). Which aggregate types
//! are ordered lives below, in `ordered_types.rs`: the handle reads it,
//! never the reverse.

mod config;
mod handle;
mod statements;
mod table;
mod wal;

pub use self::config::{Capture, DEFAULT_MAX_PAYLOAD_BYTES, OutboxConfig};
pub use self::handle::Outbox;
