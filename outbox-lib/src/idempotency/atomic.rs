//! Atomic mode: claim, business write, events and recorded response in one
//! transaction.

use sqlx::{PgConnection, SqlStr};

use crate::error::{Error, Result};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{Existing, Idempotency, RecordedResponse};

/// A key this transaction claimed: run the operation, then
/// [`Idempotency::record`] its response before committing.
#[derive(Debug)]
#[must_use = "record the response with Idempotency::record before committing"]
pub struct ClaimedKey {
    pub(crate) scope: String,
    pub(crate) key: IdempotencyKey,
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

impl Idempotency {
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
        let old = self.bound_wait(conn).await?;
        let claim = self
            .claim_bounded(conn, scope, key, fingerprint)
            .await
            .map_err(|e| self.in_use_on_timeout(e))?;
        // Restore the caller's setting for the business write.
        self.restore_wait(conn, &old).await?;
        Ok(claim)
    }

    async fn claim_bounded(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<Claim> {
        let sql = &self.inner.sql;
        let execute = || {
            Claim::Execute(ClaimedKey {
                scope: scope.to_owned(),
                key: key.clone(),
            })
        };
        for _ in 0..CLAIM_ROUNDS {
            // Blocks while a concurrent transaction holds an uncommitted
            // row for this key; writes nothing if that one committed.
            if self
                .write_claim(conn, &sql.insert, scope, key, fingerprint)
                .await?
            {
                return Ok(execute());
            }
            let Some(row) = sqlx::query(sql.select.clone())
                .bind(scope)
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
                .await?
            else {
                continue; // deleted by cleanup in between: try again
            };
            let existing = Existing::from_row(&row)?;
            if existing.expired {
                if self
                    .write_claim(conn, &sql.replace_expired, scope, key, fingerprint)
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
                        .max(self.retry_after()),
                }),
            };
        }
        Err(Error::IdempotencyKeyInUse {
            retry_after: self.retry_after(),
        })
    }

    /// Writes an atomic claim with `statement` (`insert`, or
    /// `replace_expired`: the same binds): no recovery point, no lease, no
    /// owner. True when it wrote the row.
    async fn write_claim(
        &self,
        conn: &mut PgConnection,
        statement: &SqlStr,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<bool> {
        let written: Option<bool> = sqlx::query_scalar(statement.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(self.ttl_secs())
            .bind(None::<String>)
            .bind(None::<f64>)
            .bind(None::<uuid::Uuid>)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(written.is_some())
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
        self.complete_row(conn, &claimed.scope, &claimed.key, None, response)
            .await
    }

    pub(crate) async fn complete_row(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        owner: Option<uuid::Uuid>,
        response: &RecordedResponse,
    ) -> Result<()> {
        let headers = self.recordable(response)?;
        let done = sqlx::query(self.inner.sql.complete.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(i32::from(response.status))
            .bind(headers)
            .bind(&response.body)
            .bind(owner)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if done == 1 {
            Ok(())
        } else {
            Err(Error::IdempotencyKeyNotHeld)
        }
    }
}
