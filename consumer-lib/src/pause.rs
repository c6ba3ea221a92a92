//! What the supervision (`session.rs`) and the batch stages it drives
//! (`process/`) share: the first delay of their backoffs (the pause itself
//! is `outbox_core::backoff::Backoff::pause`) and why a session ended
//! without error. A lower layer than both, so the stages never import from
//! their caller.

use std::time::Duration;

/// The first delay of every backoff (reconnects, database outages,
/// failing batches).
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Why a broker session ended without error.
pub(crate) enum End {
    Shutdown,
}
