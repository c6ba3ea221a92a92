//! Two-phase mode: for operations with an effect outside this database.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::error::{Error, Result};
#[cfg(doc)]
use crate::idempotency::Idempotency;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{Claimant, RecordedResponse, Store, downstream_key};

/// The recovery point of a freshly started two-phase operation.
pub const RECOVERY_POINT_STARTED: &str = "started";

/// A two-phase operation this process owns (it holds the lease).
#[derive(Debug)]
#[must_use = "finish with Idempotency::complete or Idempotency::release"]
pub struct TwoPhaseRun {
    scope: String,
    key: IdempotencyKey,
    owner: Uuid,
    recovery_point: String,
    resumed: bool,
}

impl TwoPhaseRun {
    /// The scope of the operation.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The client's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Where to resume: [`RECOVERY_POINT_STARTED`] for a new operation,
    /// else the last point passed to [`Idempotency::checkpoint`].
    pub fn recovery_point(&self) -> &str {
        &self.recovery_point
    }

    /// True when this run took over an earlier attempt whose lease expired
    /// (a crash, or a timeout): steps before [`TwoPhaseRun::recovery_point`]
    /// are done, the step after it may or may not have happened.
    pub fn is_resumed(&self) -> bool {
        self.resumed
    }

    /// The idempotency key to send to the external service: the same for
    /// every attempt of this operation ([`downstream_key`]).
    pub fn downstream_key(&self) -> Uuid {
        downstream_key(&self.scope, &self.key)
    }
}

/// The outcome of [`Idempotency::begin_two_phase`].
#[derive(Debug)]
pub enum TwoPhaseStart {
    /// This process owns the operation: run it from
    /// [`TwoPhaseRun::recovery_point`].
    Run(TwoPhaseRun),
    /// The operation completed earlier: answer with this response.
    Replay(RecordedResponse),
}

/// [`Idempotency::begin_two_phase`]: claims (`scope`, `key`) with a lease
/// in a transaction of its own and commits it.
pub(super) async fn begin(
    store: &Store,
    scope: &str,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
) -> Result<TwoPhaseStart> {
    let mut conn = store.pool().acquire().await?;
    let mut tx = conn.begin().await?;
    store.bound_wait(&mut tx).await?;
    let start = begin_locked(store, &mut tx, scope, key, fingerprint)
        .await
        .map_err(|e| store.in_use_on_timeout(e))?;
    tx.commit().await?;
    Ok(start)
}

async fn begin_locked(
    store: &Store,
    conn: &mut PgConnection,
    scope: &str,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
) -> Result<TwoPhaseStart> {
    let owner = Uuid::now_v7();
    let run = |recovery_point: String, resumed: bool| {
        TwoPhaseStart::Run(TwoPhaseRun {
            scope: scope.to_owned(),
            key: key.clone(),
            owner,
            recovery_point,
            resumed,
        })
    };
    let fresh = Claimant::TwoPhase {
        recovery_point: RECOVERY_POINT_STARTED,
        owner,
    };
    for _ in 0..5 {
        // A new key, or an expired record replaced, at the start with a
        // fresh lease.
        for replace_expired in [false, true] {
            if store
                .write_claim(conn, replace_expired, scope, key, fingerprint, fresh)
                .await?
            {
                return Ok(run(RECOVERY_POINT_STARTED.to_owned(), false));
            }
        }
        let Some(existing) = store.read(conn, scope, key, true).await? else {
            continue;
        };
        if existing.expired {
            continue; // expired between the two statements: replace it
        }
        if existing.fingerprint != Some(fingerprint) {
            return Err(Error::IdempotencyKeyMismatch);
        }
        if let (true, Some(response)) = (existing.completed, existing.response) {
            return Ok(TwoPhaseStart::Replay(response));
        }
        if let Some(left) = existing.lease_left {
            return Err(Error::IdempotencyKeyInUse {
                retry_after: left.max(store.retry_after()),
            });
        }
        // The row is locked (FOR UPDATE), so the takeover cannot race.
        if let Some(point) = store.take_over(conn, scope, key, owner).await? {
            let point = point
                .or(existing.recovery_point)
                .unwrap_or_else(|| RECOVERY_POINT_STARTED.to_owned());
            return Ok(run(point, true));
        }
    }
    Err(Error::IdempotencyKeyInUse {
        retry_after: store.retry_after(),
    })
}

/// [`Idempotency::checkpoint`].
pub(super) async fn checkpoint(
    store: &Store,
    conn: &mut PgConnection,
    run: &mut TwoPhaseRun,
    recovery_point: &str,
) -> Result<()> {
    if !store
        .checkpoint(conn, &run.scope, &run.key, recovery_point, run.owner)
        .await?
    {
        return Err(Error::IdempotencyKeyNotHeld);
    }
    recovery_point.clone_into(&mut run.recovery_point);
    Ok(())
}

/// [`Idempotency::complete`].
pub(super) async fn complete(
    store: &Store,
    conn: &mut PgConnection,
    run: TwoPhaseRun,
    response: &RecordedResponse,
) -> Result<()> {
    store
        .complete(conn, &run.scope, &run.key, Some(run.owner), response)
        .await
}

/// [`Idempotency::release`].
pub(super) async fn release(store: &Store, run: TwoPhaseRun) -> Result<()> {
    store.release(&run.scope, &run.key, run.owner).await
}
