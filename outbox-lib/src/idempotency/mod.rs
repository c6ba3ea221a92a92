//! HTTP Idempotency-Key handling: a retried request executes once, in the
//! same transaction as the business write and its events. The contract is
//! in [`docs/IDEMPOTENCY.md`](https://github.com/outbox-rs/outbox/blob/main/docs/IDEMPOTENCY.md).

mod atomic;
#[cfg(feature = "axum")]
mod axum;
mod fingerprint;
mod handle;
mod key;
mod store;
mod two_phase;

pub use self::atomic::{Claim, ClaimedKey};
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::axum::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotent, IdempotentRoute, require_finish,
};
pub use self::fingerprint::Fingerprint;
pub use self::handle::Idempotency;
pub use self::key::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
pub use self::store::{
    DEFAULT_IDEMPOTENCY_TTL, DEFAULT_IDEMPOTENCY_WAIT, DEFAULT_MAX_RESPONSE_BYTES,
    DOWNSTREAM_KEY_NAMESPACE, IdempotencyConfig, RecordedResponse, cleanup_idempotency_keys,
    downstream_key,
};
pub use self::two_phase::{RECOVERY_POINT_STARTED, TwoPhaseRun, TwoPhaseStart};
