//! Internals shared by the crates of the outbox toolkit: `outbox` (the
//! producer), `outbox-consumer`, `outbox-relay` (the relay engine) and `outbox-relay-ops` (its binary and operator tools).
//!
//! **No stable API.** Each of those crates depends on one exact version of
//! this crate (`=x.y.z`), so anything here may change in any release.
//! Depend on them, not on this crate; the parts meant for users are
//! re-exported there (`outbox::Ident`, `outbox::redact`).
//!
//! One home per helper: the AMQP message contract's names ([`wire`]), SQL
//! identifiers ([`Ident`]) and the one way to put them into a statement
//! ([`sql`]), the migration runner
//! ([`migrate`]), which database errors are worth retrying ([`db`]),
//! exponential backoff with jitter ([`backoff`]), one log line per outage
//! ([`outage`]), a consumer's queue names ([`queues`]), passwords kept out of logs ([`redact`]), URLs read and checked
//! ([`urls`]) and, with the
//! `amqp` feature, the broker seam ([`amqp`]): bounded calls, connecting
//! with failover, flow control, the one broker error (`BrokerError`) and
//! the message an event becomes (`event_properties`, `json_header_value`:
//! one copy for the relay, the consumer's test events and the console).
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub mod amqp;
pub mod backoff;
pub mod db;
mod ident;
pub mod migrate;
pub mod outage;
pub mod queues;
pub mod redact;
pub mod sql;
pub mod urls;
pub mod wire;

pub use crate::ident::{
    Ident, InvalidIdentifier, MAX_SCHEMA_LEN, wakeup_channel, wal_message_prefix, wal_slot_name,
};

/// 64 random bits, different at every call: good for jitter and trace
/// ids, not for secrets. (The standard library's per-process random hash
/// keys, advanced at every call, so no RNG crate is needed.)
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}
