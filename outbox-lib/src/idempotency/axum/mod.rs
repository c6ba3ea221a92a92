//! axum integration: the [`Idempotent`] extractor.
//!
//! By stage: `route.rs` (the [`IdempotentRoute`] settings, and what a
//! route reads before the claim: the bounded body, the key, the gate),
//! `extractor.rs` (begin: claim the key in a new transaction;
//! [`Idempotent::finish`]: record the response, commit), `gate.rs` (concurrent requests with one
//! key wait in process), `body.rs` (bounded body buffering), `problem.rs`
//! (problem documents, errors as responses) and `finish.rs` (the
//! [`require_finish`] middleware).

mod body;
mod extractor;
mod finish;
mod gate;
mod problem;
mod route;

pub use self::extractor::Idempotent;
pub use self::finish::require_finish;
pub use self::route::IdempotentRoute;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header marking a replayed response (value `true`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
