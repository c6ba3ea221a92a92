//! [`Idempotency`], the service's handle: its public methods, each the
//! entry of a mode (`atomic.rs`, `two_phase.rs`) over the table
//! ([`Store`]).

use std::sync::Arc;

use sqlx::{PgConnection, PgPool};

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::idempotency::atomic::{self, Claim, ClaimedKey};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{IdempotencyConfig, RecordedResponse, Store};
#[cfg(doc)]
use crate::idempotency::two_phase::RECOVERY_POINT_STARTED;
use crate::idempotency::two_phase::{self, TwoPhaseRun, TwoPhaseStart};

/// The service's handle on its idempotency keys. Cheap to clone; create
/// one at start-up.
///
/// Atomic mode ([`Idempotency::claim`], [`Idempotency::record`]) runs the
/// claim, the business write, its events and the recorded response in the
/// caller's transaction. Two-phase mode ([`Idempotency::begin_two_phase`])
/// is for operations with an effect outside this database.
#[derive(Debug, Clone)]
pub struct Idempotency {
    store: Arc<Store>,
}

impl Idempotency {
    /// Validates `config` and checks that the schema is migrated.
    pub async fn new(pool: &PgPool, config: IdempotencyConfig) -> Result<Self> {
        Ok(Self {
            store: Arc::new(Store::new(pool, config).await?),
        })
    }

    /// The schema holding `idempotency_keys`.
    pub fn schema(&self) -> &str {
        self.store.schema()
    }

    /// The pool given to [`Idempotency::new`].
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// The settings in force.
    pub fn config(&self) -> &IdempotencyConfig {
        self.store.config()
    }

    /// Claims (`scope`, `key`) in the caller's transaction.
    ///
    /// The claim is an uncommitted row: a concurrent request with the same
    /// key blocks on it (the database arbitrates) for up to the configured
    /// wait, then replays the committed response, or executes if the first
    /// transaction rolled back or its connection died. Nothing outlives the
    /// transaction: no lock, no lease. Run it in a READ COMMITTED
    /// transaction (PostgreSQL's default).
    ///
    /// Errors: [`Error::IdempotencyKeyMismatch`] when the key was used with
    /// another request; [`Error::IdempotencyKeyInUse`] when a concurrent
    /// request holds the key past the wait. After an error, roll the
    /// transaction back.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, idem: outbox::idempotency::Idempotency, outbox: outbox::Outbox) -> anyhow::Result<()> {
    /// use outbox::NewEvent;
    /// use outbox::idempotency::{Claim, Fingerprint, IdempotencyKey, RecordedResponse};
    /// let key = IdempotencyKey::parse("8e03978e-40d5-43e8")?;
    /// let body = br#"{"sku":"A-1"}"#;
    /// let mut tx = pool.begin().await?;
    /// let response = match idem
    ///     .claim(&mut *tx, "tenant-7 POST /orders", &key, Fingerprint::of_request("POST", "/orders", body))
    ///     .await?
    /// {
    ///     Claim::Replay(recorded) => recorded, // tx is dropped: rolls back, wrote nothing
    ///     Claim::Execute(claimed) => {
    ///         sqlx::query("INSERT INTO orders (id, sku) VALUES ('o-42', 'A-1')").execute(&mut *tx).await?;
    ///         outbox.enqueue(&mut *tx, NewEvent::new("order", "o-42", "OrderPlaced", &serde_json::json!({}))?).await?;
    ///         let response = RecordedResponse::new(201, br#"{"id":"o-42"}"#.to_vec())
    ///             .header("content-type", "application/json");
    ///         idem.record(&mut *tx, claimed, &response).await?;
    ///         outbox.commit(tx).await?; // key, order, event and response: all or nothing
    ///         response
    ///     }
    /// };
    /// # let _ = response; Ok(()) }
    /// ```
    pub async fn claim(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<Claim> {
        atomic::claim(&self.store, conn, scope, key, fingerprint).await
    }

    /// Records `response` for a key claimed by [`Idempotency::claim`] in
    /// the same transaction. It commits or rolls back with that
    /// transaction. Only headers on the replay allow-list are stored.
    ///
    /// Record successes and deliberate rejections; for a server error, roll
    /// back instead so a retry executes again
    /// ([`RecordedResponse::is_recordable`]). Fails with
    /// [`Error::ResponseTooLarge`] over the size cap (roll back then too).
    pub async fn record(
        &self,
        conn: &mut PgConnection,
        claimed: ClaimedKey,
        response: &RecordedResponse,
    ) -> Result<()> {
        atomic::record(&self.store, conn, claimed, response).await
    }

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
        two_phase::begin(&self.store, scope, key, fingerprint).await
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
        two_phase::checkpoint(&self.store, conn, run, recovery_point).await
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
        two_phase::complete(&self.store, conn, run, response).await
    }

    /// Gives up the lease after a failure (a server error, say) without
    /// recording a response, so a retry resumes at once from the last
    /// recovery point instead of waiting for the lease to expire.
    pub async fn release(&self, run: TwoPhaseRun) -> Result<()> {
        two_phase::release(&self.store, run).await
    }
}
