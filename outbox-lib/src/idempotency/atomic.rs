//! Atomic mode: claim, business write, events and recorded response in one
//! transaction.

use sqlx::PgConnection;

use crate::error::{Error, Result};
#[cfg(doc)]
use crate::idempotency::Idempotency;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{Claimant, RecordedResponse, Store};

/// A key this transaction claimed: run the operation, then
/// [`Idempotency::record`] its response before committing.
#[derive(Debug)]
#[must_use = "record the response with Idempotency::record before committing"]
pub struct ClaimedKey {
    scope: String,
    key: IdempotencyKey,
}

impl ClaimedKey {
    /// The scope of the claim.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The claimed key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

/// The outcome of [`Idempotency::claim`].
#[derive(Debug)]
pub enum Claim {
    /// The key is new (or its record expired): execute the operation.
    Execute(ClaimedKey),
    /// The operation already ran: answer with this response (adding
    /// `Idempotent-Replayed: true`) and write nothing.
    Replay(RecordedResponse),
}

// A claim retries when a record it saw vanishes (cleanup) or is replaced
// under it; a handful of rounds is more than any real interleaving needs.
const CLAIM_ROUNDS: usize = 5;

/// [`Idempotency::claim`]: claims (`scope`, `key`) in the caller's
/// transaction, waiting on a concurrent claim for at most the wait bound.
pub(super) async fn claim(
    store: &Store,
    conn: &mut PgConnection,
    scope: &str,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
) -> Result<Claim> {
    let old = store.bound_wait(conn).await?;
    let claim = claim_bounded(store, conn, (scope, key, fingerprint))
        .await
        .map_err(|e| store.in_use_on_timeout(e))?;
    // Restore the caller's setting for the business write.
    store.restore_wait(conn, &old).await?;
    Ok(claim)
}

/// The claim, under the wait bound [`claim`] set.
async fn claim_bounded(
    store: &Store,
    conn: &mut PgConnection,
    (scope, key, fingerprint): (&str, &IdempotencyKey, Fingerprint),
) -> Result<Claim> {
    let execute = || {
        Claim::Execute(ClaimedKey {
            scope: scope.to_owned(),
            key: key.clone(),
        })
    };
    for _ in 0..CLAIM_ROUNDS {
        // Blocks while a concurrent transaction holds an uncommitted
        // row for this key; writes nothing if that one committed.
        if store
            .write_claim(conn, false, scope, key, fingerprint, Claimant::Atomic)
            .await?
        {
            return Ok(execute());
        }
        let Some(existing) = store.read(conn, scope, key, false).await? else {
            continue; // deleted by cleanup in between: try again
        };
        if existing.expired {
            if store
                .write_claim(conn, true, scope, key, fingerprint, Claimant::Atomic)
                .await?
            {
                return Ok(execute());
            }
            continue;
        }
        if existing.fingerprint != Some(fingerprint) {
            return Err(Error::IdempotencyKeyMismatch);
        }
        return match existing.response {
            Some(response) if existing.completed => Ok(Claim::Replay(response)),
            // A committed in-progress record is a two-phase claim.
            _ => Err(Error::IdempotencyKeyInUse {
                retry_after: existing
                    .lease_left
                    .unwrap_or_default()
                    .max(store.retry_after()),
            }),
        };
    }
    Err(Error::IdempotencyKeyInUse {
        retry_after: store.retry_after(),
    })
}

/// [`Idempotency::record`]: the response of a key this transaction claimed.
pub(super) async fn record(
    store: &Store,
    conn: &mut PgConnection,
    claimed: ClaimedKey,
    response: &RecordedResponse,
) -> Result<()> {
    store
        .complete(conn, &claimed.scope, &claimed.key, None, response)
        .await
}
