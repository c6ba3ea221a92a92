//! Two-phase mode: for operations with an effect outside this database.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{Existing, Idempotency, RecordedResponse, downstream_key};

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

impl Idempotency {
    /// Phase 1: claims (`scope`, `key`) and **commits** the claim as
    /// `in_progress` with a lease, before any external call.
    ///
    /// A new key starts at [`RECOVERY_POINT_STARTED`]. A key whose lease
    /// expired (its holder crashed or stalled) is taken over and resumes
    /// at its recorded recovery point. A live lease fails with
    /// [`Error::IdempotencyKeyInUse`] (HTTP 409, `Retry-After` = the lease
    /// left); another request under the key fails with
    /// [`Error::IdempotencyKeyMismatch`].
    ///
    /// The external call is at-least-once: a holder may die after calling
    /// out and before [`Idempotency::checkpoint`]. Send
    /// [`TwoPhaseRun::downstream_key`] with it so the external service
    /// deduplicates the repeat.
    ///
    /// ```no_run
    /// # async fn charge(_key: uuid::Uuid) -> anyhow::Result<String> { Ok("ch_1".into()) }
    /// # async fn demo(idem: outbox::idempotency::Idempotency) -> anyhow::Result<()> {
    /// use outbox::idempotency::{Fingerprint, IdempotencyKey, RecordedResponse, TwoPhaseStart};
    /// let key = IdempotencyKey::parse("pay-7f3a")?;
    /// let fp = Fingerprint::of_request("POST", "/payments", b"{}");
    /// match idem.begin_two_phase("tenant-7 POST /payments", &key, fp).await? {
    ///     TwoPhaseStart::Replay(recorded) => { let _ = recorded; }
    ///     TwoPhaseStart::Run(mut run) => {
    ///         // Same downstream key on the first try and after any crash.
    ///         let charge_id = charge(run.downstream_key()).await?;
    ///         let mut tx = idem.pool().begin().await?;
    ///         idem.checkpoint(&mut *tx, &mut run, "charged").await?;
    ///         idem.complete(&mut *tx, run, &RecordedResponse::new(201, charge_id.into_bytes())).await?;
    ///         tx.commit().await?;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin_two_phase(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<TwoPhaseStart> {
        let mut conn = self.inner.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        self.bound_wait(&mut tx).await?;
        let start = self
            .begin_locked(&mut tx, scope, key, fingerprint)
            .await
            .map_err(|e| self.in_use_on_timeout(e))?;
        tx.commit().await?;
        Ok(start)
    }

    async fn begin_locked(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<TwoPhaseStart> {
        let sql = &self.inner.sql;
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
        for _ in 0..5 {
            if self
                .claim_fresh(conn, scope, key, fingerprint, owner)
                .await?
            {
                return Ok(run(RECOVERY_POINT_STARTED.to_owned(), false));
            }
            let Some(row) = sqlx::query(sql.select_for_update.clone())
                .bind(scope)
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
                .await?
            else {
                continue;
            };
            let existing = Existing::from_row(&row)?;
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
                    retry_after: left.max(self.retry_after()),
                });
            }
            // The row is locked (FOR UPDATE), so the takeover cannot race.
            if let Some(point) = self.take_over(conn, scope, key, owner).await? {
                let point = point
                    .or(existing.recovery_point)
                    .unwrap_or_else(|| RECOVERY_POINT_STARTED.to_owned());
                return Ok(run(point, true));
            }
        }
        Err(Error::IdempotencyKeyInUse {
            retry_after: self.retry_after(),
        })
    }

    /// Claims a new key, or replaces an expired record, for `owner` at
    /// [`RECOVERY_POINT_STARTED`] with a fresh lease. True when either
    /// statement wrote the row.
    async fn claim_fresh(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        owner: Uuid,
    ) -> Result<bool> {
        let sql = &self.inner.sql;
        for statement in [&sql.insert, &sql.replace_expired] {
            let claimed: Option<bool> = sqlx::query_scalar(statement.clone())
                .bind(scope)
                .bind(key.as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(self.ttl_secs())
                .bind(RECOVERY_POINT_STARTED)
                .bind(self.lease_secs())
                .bind(owner)
                .fetch_optional(&mut *conn)
                .await?;
            if claimed.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Gives the lease of an in-progress record whose lease ran out to
    /// `owner`: `None` when nothing was taken over, else the recovery point
    /// the record holds (`None` inside when it holds none).
    async fn take_over(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        owner: Uuid,
    ) -> Result<Option<Option<String>>> {
        Ok(sqlx::query_scalar(self.inner.sql.take_over.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(self.lease_secs())
            .bind(owner)
            .fetch_optional(&mut *conn)
            .await?)
    }

    /// Records that the operation passed `recovery_point` and renews the
    /// lease. It commits with the caller's transaction, so write the local
    /// effects of the step in the same one. Fails with
    /// [`Error::IdempotencyKeyNotHeld`] when the lease was taken over.
    pub async fn checkpoint(
        &self,
        conn: &mut PgConnection,
        run: &mut TwoPhaseRun,
        recovery_point: &str,
    ) -> Result<()> {
        let n = sqlx::query(self.inner.sql.checkpoint.clone())
            .bind(&run.scope)
            .bind(run.key.as_str())
            .bind(recovery_point)
            .bind(self.lease_secs())
            .bind(run.owner)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if n != 1 {
            return Err(Error::IdempotencyKeyNotHeld);
        }
        recovery_point.clone_into(&mut run.recovery_point);
        Ok(())
    }

    /// Phase 2: records the response and ends the lease, in the caller's
    /// transaction (commit it). Fails with [`Error::IdempotencyKeyNotHeld`]
    /// when another attempt took the key over, and with
    /// [`Error::ResponseTooLarge`] over the size cap.
    pub async fn complete(
        &self,
        conn: &mut PgConnection,
        run: TwoPhaseRun,
        response: &RecordedResponse,
    ) -> Result<()> {
        self.complete_row(conn, &run.scope, &run.key, Some(run.owner), response)
            .await
    }

    /// Gives up the lease after a failure (a server error, say) without
    /// recording a response, so a retry resumes at once from the last
    /// recovery point instead of waiting for the lease to expire.
    pub async fn release(&self, run: TwoPhaseRun) -> Result<()> {
        sqlx::query(self.inner.sql.release.clone())
            .bind(&run.scope)
            .bind(run.key.as_str())
            .bind(run.owner)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }
}
