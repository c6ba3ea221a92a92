//! The `idempotency_keys` table: configuration, its SQL ([`Store`]), the
//! recorded response and retention.

use std::time::Duration;

use outbox_core::sql::render;
use sqlx::{PgConnection, PgPool, Row, SqlStr};
use uuid::Uuid;

use crate::error::{Error, Result};
#[cfg(doc)]
use crate::idempotency::Idempotency;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::migrate::PRODUCER;
use outbox_core::Ident;
use outbox_core::migrate::ensure_migrated;

/// Default retention of a key: 24 hours. A client may retry with the same
/// key for this long and get the recorded response; after it, the key
/// executes anew.
pub const DEFAULT_IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Default bound on how long a request waits for a concurrent request with
/// the same key before it gets 409: 10 seconds.
pub const DEFAULT_IDEMPOTENCY_WAIT: Duration = Duration::from_secs(10);

/// Default largest recorded response body: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// Namespace of the downstream keys derived by [`downstream_key`].
pub const DOWNSTREAM_KEY_NAMESPACE: Uuid =
    Uuid::from_u128(0x2f6b_0d3e_8a41_4c7a_b5e2_91d0_6c3f_7a18);

/// Settings of an [`Idempotency`] handle. Every duration is a contract
/// with clients or operators; see [`docs/IDEMPOTENCY.md`](https://github.com/outbox-rs/outbox/blob/main/docs/IDEMPOTENCY.md).
///
/// Like every configuration of the toolkit: start from
/// [`IdempotencyConfig::default()`], assign the fields you change;
/// [`Idempotency::new`] validates the result.
///
/// ```
/// # use std::time::Duration;
/// let mut config = outbox::idempotency::IdempotencyConfig::default();
/// config.schema = "shop".into();
/// config.ttl = Duration::from_secs(48 * 3600);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct IdempotencyConfig {
    /// The schema holding `idempotency_keys` (default `public`).
    pub schema: String,
    /// How long a key is kept (default [`DEFAULT_IDEMPOTENCY_TTL`]). Must
    /// outlast every client's retry horizon: a retry after it executes anew.
    pub ttl: Duration,
    /// How long a request waits for a concurrent request with the same key
    /// to finish (default [`DEFAULT_IDEMPOTENCY_WAIT`]); past it the request
    /// fails with [`Error::IdempotencyKeyInUse`] (HTTP 409).
    /// `Duration::ZERO` means do not wait: a concurrent request gets 409 at
    /// once.
    pub wait: Duration,
    /// The `Retry-After` suggested with a 409 for a key held by a
    /// concurrent atomic request (default 1 s).
    pub retry_after: Duration,
    /// Two-phase mode: how long a claim is owned without renewal (default
    /// 60 s). After it, a retry takes the key over and resumes. Set it
    /// longer than the external call's timeout.
    pub lease: Duration,
    /// Largest response body recorded (default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`]); a larger one fails with
    /// [`Error::ResponseTooLarge`] and is not recorded.
    pub max_response_bytes: usize,
    /// Response headers recorded and replayed, by case-insensitive name
    /// (default `content-type` and `location`). Others are not stored.
    pub replay_headers: Vec<String>,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            ttl: DEFAULT_IDEMPOTENCY_TTL,
            wait: DEFAULT_IDEMPOTENCY_WAIT,
            retry_after: Duration::from_secs(1),
            lease: Duration::from_secs(60),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            replay_headers: vec!["content-type".to_owned(), "location".to_owned()],
        }
    }
}

/// A response as recorded in `idempotency_keys` and replayed to retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The recorded headers, names lowercase, in order (a name may repeat).
    pub headers: Vec<(String, String)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl RecordedResponse {
    /// A response with no headers.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header (kept only if it is on the replay allow-list when
    /// recorded).
    pub fn header(mut self, name: impl AsRef<str>, value: impl Into<String>) -> Self {
        self.headers
            .push((name.as_ref().to_ascii_lowercase(), value.into()));
        self
    }

    /// Whether the recording rule keeps a response with `status`: successes
    /// and deliberate rejections (below 500) are recorded and replayed;
    /// server errors are not, so a retry executes again.
    pub fn is_recordable(status: u16) -> bool {
        status < 500
    }
}

/// The downstream idempotency key for an external call made under
/// (`scope`, `key`) in two-phase mode: a UUIDv5 in
/// [`DOWNSTREAM_KEY_NAMESPACE`] over the length-prefixed scope and key.
/// Deterministic, so every attempt of one operation (first try, resume
/// after a crash, takeover) sends the same key to the external service.
pub fn downstream_key(scope: &str, key: &IdempotencyKey) -> Uuid {
    let mut name = Vec::with_capacity(16 + scope.len() + key.as_str().len());
    for part in [scope.as_bytes(), key.as_str().as_bytes()] {
        name.extend_from_slice(&(part.len() as u64).to_be_bytes());
        name.extend_from_slice(part);
    }
    Uuid::new_v5(&DOWNSTREAM_KEY_NAMESPACE, &name)
}

/// Deletes expired idempotency records from `schema`, at most 1,000 a
/// statement, oldest first, each statement starting where the last one
/// stopped (so a held xmin horizon does not make a pass walk its own dead
/// entries again), and returns how many it deleted. Expired records already count as absent
/// when read, so this only reclaims space; run it periodically (hourly is
/// plenty).
pub async fn cleanup_idempotency_keys(pool: &PgPool, schema: &str) -> Result<u64> {
    let schema = Ident::new("schema", schema)?;
    let sql = render(include_str!("store/cleanup.sql"), &schema);
    Ok(
        outbox_core::db::delete_in_chunks(pool, 1_000, |cursor, chunk| {
            sqlx::query_as(sql.clone()).bind(cursor).bind(chunk)
        })
        .await?,
    )
}

/// The `idempotency_keys` table of one schema: its statements, built once,
/// and the settings they bind. The modes (`atomic.rs`, `two_phase.rs`)
/// read and write keys only through it.
#[derive(Debug)]
pub(super) struct Store {
    pool: PgPool,
    schema: Ident,
    config: IdempotencyConfig,
    sql: Statements,
}

/// Who writes a claim: an atomic claim holds no lease; a two-phase one
/// starts at a recovery point with a lease for its owner.
#[derive(Debug, Clone, Copy)]
pub(super) enum Claimant<'a> {
    Atomic,
    TwoPhase {
        recovery_point: &'a str,
        owner: Uuid,
    },
}

impl Store {
    /// Validates `config` and checks that the schema is migrated.
    pub(super) async fn new(pool: &PgPool, mut config: IdempotencyConfig) -> Result<Self> {
        let schema = Ident::new("schema", &config.schema)?;
        for name in &mut config.replay_headers {
            name.make_ascii_lowercase();
        }
        ensure_migrated(pool, &PRODUCER, &schema).await?;
        Ok(Self {
            pool: pool.clone(),
            sql: Statements::new(&schema),
            schema,
            config,
        })
    }

    pub(super) fn schema(&self) -> &str {
        self.schema.as_str()
    }

    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(super) fn config(&self) -> &IdempotencyConfig {
        &self.config
    }

    /// The `Retry-After` of a key held by someone else.
    pub(super) fn retry_after(&self) -> Duration {
        self.config.retry_after
    }

    /// Writes a claim of (`scope`, `key`): a new record, or with
    /// `replace_expired` over an expired one. True when it wrote the row;
    /// a new record blocks while a concurrent transaction holds an
    /// uncommitted one for the key.
    pub(super) async fn write_claim(
        &self,
        conn: &mut PgConnection,
        replace_expired: bool,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        claimant: Claimant<'_>,
    ) -> Result<bool> {
        let statement = if replace_expired {
            &self.sql.replace_expired
        } else {
            &self.sql.insert
        };
        let (recovery_point, lease, owner) = match claimant {
            Claimant::Atomic => (None, None, None),
            Claimant::TwoPhase {
                recovery_point,
                owner,
            } => (
                Some(recovery_point),
                Some(self.config.lease.as_secs_f64()),
                Some(owner),
            ),
        };
        let written: Option<bool> = sqlx::query_scalar(statement.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(self.config.ttl.as_secs_f64())
            .bind(recovery_point)
            .bind(lease)
            .bind(owner)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(written.is_some())
    }

    /// The record of (`scope`, `key`), locked with `for_update`; `None`
    /// when there is none (or cleanup deleted it).
    pub(super) async fn read(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        for_update: bool,
    ) -> Result<Option<Existing>> {
        let statement = if for_update {
            &self.sql.select_for_update
        } else {
            &self.sql.select
        };
        sqlx::query(statement.clone())
            .bind(scope)
            .bind(key.as_str())
            .fetch_optional(&mut *conn)
            .await?
            .as_ref()
            .map(Existing::from_row)
            .transpose()
    }

    /// Gives the lease of an in-progress record whose lease ran out to
    /// `owner`: `None` when nothing was taken over, else the recovery point
    /// the record holds (`None` inside when it holds none).
    pub(super) async fn take_over(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        owner: Uuid,
    ) -> Result<Option<Option<String>>> {
        Ok(sqlx::query_scalar(self.sql.take_over.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(self.config.lease.as_secs_f64())
            .bind(owner)
            .fetch_optional(&mut *conn)
            .await?)
    }

    /// Records `point` for the run `owner` holds and renews its lease.
    /// False when the lease was taken over.
    pub(super) async fn checkpoint(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        point: &str,
        owner: Uuid,
    ) -> Result<bool> {
        let n = sqlx::query(self.sql.checkpoint.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(point)
            .bind(self.config.lease.as_secs_f64())
            .bind(owner)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        Ok(n == 1)
    }

    /// Records `response` and completes the key, held by `owner` (`None`:
    /// an atomic claim); [`Error::IdempotencyKeyNotHeld`] when it is not
    /// held so.
    pub(super) async fn complete(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        owner: Option<Uuid>,
        response: &RecordedResponse,
    ) -> Result<()> {
        let headers = self.recordable(response)?;
        let done = sqlx::query(self.sql.complete.clone())
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

    /// Ends `owner`'s lease without a response.
    pub(super) async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        owner: Uuid,
    ) -> Result<()> {
        sqlx::query(self.sql.release.clone())
            .bind(scope)
            .bind(key.as_str())
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Keeps the allow-listed headers and checks the size cap.
    fn recordable(&self, response: &RecordedResponse) -> Result<serde_json::Value> {
        let limit = self.config.max_response_bytes;
        if response.body.len() > limit {
            return Err(Error::ResponseTooLarge {
                size: response.body.len(),
                limit,
            });
        }
        let allowed = &self.config.replay_headers;
        Ok(response
            .headers
            .iter()
            .filter(|(name, _)| allowed.iter().any(|a| a.eq_ignore_ascii_case(name)))
            .map(|(name, value)| serde_json::json!([name.to_ascii_lowercase(), value]))
            .collect())
    }

    /// Sets `lock_timeout` for this transaction to the wait bound and
    /// returns the previous value.
    pub(super) async fn bound_wait(&self, conn: &mut PgConnection) -> Result<String> {
        // lock_timeout = 0 disables the timeout, so "no wait" is 1 ms.
        let ms = self.config.wait.as_millis().clamp(1, i32::MAX as u128);
        let old: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut *conn)
            .await?;
        self.restore_wait(conn, &format!("{ms}ms")).await?;
        Ok(old)
    }

    /// Sets `lock_timeout` for the rest of the transaction.
    pub(super) async fn restore_wait(&self, conn: &mut PgConnection, value: &str) -> Result<()> {
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(value)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Maps a lock timeout to [`Error::IdempotencyKeyInUse`].
    pub(super) fn in_use_on_timeout(&self, e: Error) -> Error {
        match &e {
            Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                Error::IdempotencyKeyInUse {
                    retry_after: self.retry_after(),
                }
            }
            _ => e,
        }
    }
}

/// A row of `idempotency_keys` as the claim logic needs it.
#[derive(Debug)]
pub(super) struct Existing {
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) completed: bool,
    pub(super) expired: bool,
    pub(super) response: Option<RecordedResponse>,
    pub(super) recovery_point: Option<String>,
    /// Remaining lease; `None` when there is no live lease.
    pub(super) lease_left: Option<Duration>,
}

impl Existing {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self> {
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        let state: String = row.try_get("state")?;
        let status: Option<i32> = row.try_get("response_status")?;
        let headers: serde_json::Value = row.try_get("response_headers")?;
        let body: Option<Vec<u8>> = row.try_get("response_body")?;
        let lease_left: Option<f64> = row.try_get("lease_left")?;
        let response = match (status, body) {
            (Some(status), Some(body)) => Some(RecordedResponse {
                status: u16::try_from(status).unwrap_or(500),
                headers: headers_from_json(&headers),
                body,
            }),
            _ => None,
        };
        Ok(Self {
            fingerprint: Fingerprint::from_slice(&fingerprint),
            completed: state == "completed",
            expired: row.try_get("expired")?,
            response,
            recovery_point: row.try_get("recovery_point")?,
            lease_left: lease_left.and_then(lease_from_secs),
        })
    }
}

fn headers_from_json(value: &serde_json::Value) -> Vec<(String, String)> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|pair| {
            let name = pair.get(0)?.as_str()?;
            let value = pair.get(1)?.as_str()?;
            Some((name.to_owned(), value.to_owned()))
        })
        .collect()
}

/// Every statement on `idempotency_keys`, built once per schema. The schema
/// is a validated `Ident`; every value is bound.
#[derive(Debug)]
struct Statements {
    /// $1 scope, $2 key, $3 fingerprint, $4 ttl secs, $5 recovery point,
    /// $6 lease secs, $7 lease owner (the last three NULL in atomic mode).
    insert: SqlStr,
    /// Same binds as `insert`; replaces an expired record.
    replace_expired: SqlStr,
    /// $1 scope, $2 key.
    select: SqlStr,
    /// Like `select`, locking the row.
    select_for_update: SqlStr,
    /// $1 scope, $2 key, $3 lease secs, $4 new owner. Returns the recovery point.
    take_over: SqlStr,
    /// $1 scope, $2 key, $3 status, $4 headers, $5 body, $6 owner (NULL: atomic).
    complete: SqlStr,
    /// $1 scope, $2 key, $3 recovery point, $4 lease secs, $5 owner.
    checkpoint: SqlStr,
    /// $1 scope, $2 key, $3 owner.
    release: SqlStr,
}

impl Statements {
    fn new(schema: &Ident) -> Self {
        let sql = |text| render(text, schema);
        Self {
            insert: sql(include_str!("store/insert.sql")),
            replace_expired: sql(include_str!("store/replace_expired.sql")),
            select: sql(include_str!("store/select.sql")),
            select_for_update: sql(concat!(include_str!("store/select.sql"), "FOR UPDATE")),
            take_over: sql(include_str!("store/take_over.sql")),
            complete: sql(include_str!("store/complete.sql")),
            checkpoint: sql(include_str!("store/checkpoint.sql")),
            release: sql(include_str!("store/release.sql")),
        }
    }
}

/// The time left on a lease, from PostgreSQL's seconds: none when lapsed
/// (or not a number); a lease `locked_until = 'infinity'` (set by hand)
/// is held for ever, not a panic.
fn lease_from_secs(secs: f64) -> Option<Duration> {
    (secs > 0.0).then(|| Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    #[test]
    fn any_lease_value_converts_without_panicking() {
        assert_eq!(lease_from_secs(f64::INFINITY), Some(Duration::MAX));
        assert_eq!(lease_from_secs(1e300), Some(Duration::MAX));
        assert_eq!(lease_from_secs(1.5), Some(Duration::from_millis(1500)));
        assert_eq!(lease_from_secs(0.0), None);
        assert_eq!(lease_from_secs(-3.0), None);
        assert_eq!(lease_from_secs(f64::NAN), None);
        assert_eq!(lease_from_secs(f64::NEG_INFINITY), None);
    }
}
