//! Waiting under the shutdown token, shared by the supervision
//! (`session.rs`) and the batch stages it drives (`process/`): the backoff
//! pause between attempts, and why a session ended without error. A lower
//! layer than both, so the stages never import from their caller.

use std::time::Duration;

use outbox_core::backoff::Backoff;
use tokio_util::sync::CancellationToken;

/// The first delay of every backoff (reconnects, database outages,
/// failing batches).
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Why a broker session ended without error.
pub(crate) enum End {
    Shutdown,
}

/// Sleeps for the backoff's next delay (jittered, so instances that lost
/// the broker together do not all come back at the same instant); false
/// when `shutdown` fired first.
pub(crate) async fn pause(shutdown: &CancellationToken, backoff: &mut Backoff) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(backoff.next_delay()) => true,
    }
}
