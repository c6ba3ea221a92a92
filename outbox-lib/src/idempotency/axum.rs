//! axum integration: the [`Idempotent`] extractor.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, Postgres, Transaction};

use crate::error::Error;
use crate::idempotency::atomic::{Claim, ClaimedKey};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::{Idempotency, RecordedResponse};
use crate::outbox::Outbox;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header marking a replayed response (value `true`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Default largest request body an idempotent route buffers: 1 MiB.
const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

type ScopeFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

#[derive(Debug, Clone)]
enum KeySource {
    Header,
    JsonField(String),
}

/// Settings of idempotent routes; the state the [`Idempotent`] extractor
/// reads (via [`FromRef`]). Cheap to clone.
///
/// Defaults: the key is required and read from the `Idempotency-Key`
/// header; the scope is `"<method> <path>"`; the fingerprint covers the
/// method, the path with query, and the body; request bodies are buffered
/// up to 1 MiB (larger: 413).
#[derive(Clone)]
pub struct IdempotentRoute {
    idem: Idempotency,
    key_source: KeySource,
    required: bool,
    max_request_bytes: usize,
    scope: ScopeFn,
    fingerprint: FingerprintFn,
    outbox: Option<Outbox>,
    problems: ProblemTypes,
    gates: Gates,
}

/// One in-process gate per (scope, key) in use: concurrent requests with
/// the same key wait here, holding no database connection, so a client
/// repeating one request cannot take the pool; only the request holding
/// the gate holds a connection (one per key per process).
#[derive(Debug, Clone, Default)]
struct Gates {
    open: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    waiting: Arc<AtomicUsize>,
}

/// A held gate; released (and forgotten when nobody else wants it) on drop.
struct Gate {
    gates: Gates,
    key: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Gates {
    /// Waits up to `wait` for the gate of `key`; `None` past it.
    async fn enter(&self, key: String, wait: Duration) -> Option<Gate> {
        let gate = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.entry(key.clone()).or_default().clone()
        };
        let guard = match gate.clone().try_lock_owned() {
            Ok(guard) => Some(guard),
            Err(_) if wait.is_zero() => None,
            Err(_) => {
                // Counted while waiting, even if the request is dropped
                // (the client went away) mid-wait.
                struct Waiting<'a>(&'a AtomicUsize);
                impl Drop for Waiting<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, AtomicOrdering::Relaxed);
                    }
                }
                self.waiting.fetch_add(1, AtomicOrdering::Relaxed);
                let _waiting = Waiting(&self.waiting);
                tokio::time::timeout(wait, gate.lock_owned()).await.ok()
            }
        };
        let gate = Gate {
            gates: self.clone(),
            key,
            guard,
        };
        gate.guard.is_some().then_some(gate)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut open = self.gates.open.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map holds it: nobody waits for this key any more.
        if open
            .get(&self.key)
            .is_some_and(|g| Arc::strong_count(g) == 1)
        {
            open.remove(&self.key);
        }
    }
}

/// What became of the idempotent request of one HTTP request; shared by
/// [`require_finish`] and the extractor through the request extensions.
#[derive(Debug, Clone, Default)]
struct FinishMarker(Arc<std::sync::Mutex<FinishState>>);

#[derive(Debug, Default)]
enum FinishState {
    /// No idempotent request was begun.
    #[default]
    Unused,
    /// Begun (a transaction is open), not finished yet.
    Begun(ProblemTypes),
    /// [`Idempotent::finish`] was called.
    Finished,
}

impl FinishMarker {
    fn set(&self, state: FinishState) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }
}

/// axum middleware that every idempotent route runs under: a handler that
/// returns without [`Idempotent::finish`] has had its transaction rolled
/// back (its writes and its claim are gone), so the response it returned
/// would lie to the client; this answers a 500 problem document
/// (`handler-unfinished`) instead, and nothing is recorded. The
/// [`Idempotent`] extractor refuses to run on a route without it (500,
/// `route-unguarded`), so the mistake shows on the first request.
///
/// ```no_run
/// # use axum::{Router, routing::post, response::Response};
/// # use outbox::IdempotentRoute;
/// # async fn create_order(req: outbox::Idempotent) -> Response { unimplemented!() }
/// # fn router(route: IdempotentRoute) -> Router {
/// Router::new()
///     .route("/orders", post(create_order))
///     .route_layer(axum::middleware::from_fn(outbox::require_finish))
///     .with_state(route)
/// # }
/// ```
pub async fn require_finish(mut request: Request, next: axum::middleware::Next) -> Response {
    let marker = FinishMarker::default();
    request.extensions_mut().insert(marker.clone());
    let response = next.run(request).await;
    let state = std::mem::take(&mut *marker.0.lock().unwrap_or_else(|p| p.into_inner()));
    match state {
        FinishState::Begun(problems) => {
            tracing::error!(
                "idempotent handler returned without calling finish; its response was replaced by a 500 and nothing was committed"
            );
            problem(
                &problems,
                StatusCode::INTERNAL_SERVER_ERROR,
                "handler-unfinished",
                "Handler did not finish",
                "the handler returned without recording its response; nothing was committed, retry with the same key",
            )
        }
        FinishState::Unused | FinishState::Finished => response,
    }
}

/// How problem documents name their `type` (RFC 9457).
#[derive(Debug, Clone, Default)]
struct ProblemTypes {
    /// `None`: `about:blank` (with a precise `title` and a `code`).
    base: Option<Arc<str>>,
}

impl ProblemTypes {
    fn uri(&self, code: &str) -> String {
        match &self.base {
            Some(base) => format!("{base}{code}"),
            None => "about:blank".to_owned(),
        }
    }
}

impl std::fmt::Debug for IdempotentRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentRoute")
            .field("schema", &self.idem.schema())
            .field("key_source", &self.key_source)
            .field("required", &self.required)
            .field("max_request_bytes", &self.max_request_bytes)
            .finish_non_exhaustive()
    }
}

impl IdempotentRoute {
    /// Routes keyed in `idem`'s table, with the defaults above.
    pub fn new(idem: Idempotency) -> Self {
        Self {
            idem,
            key_source: KeySource::Header,
            required: true,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            scope: Arc::new(|parts| format!("{} {}", parts.method, parts.uri.path())),
            fingerprint: Arc::new(|parts, body| {
                let path = parts
                    .uri
                    .path_and_query()
                    .map_or(parts.uri.path(), |p| p.as_str());
                Fingerprint::of_request(parts.method.as_str(), path, body)
            }),
            outbox: None,
            problems: ProblemTypes::default(),
            gates: Gates::default(),
        }
    }

    /// Requests of this route waiting, in this process, for a concurrent
    /// request with the same key (they hold no database connection).
    pub fn waiting(&self) -> usize {
        self.gates.waiting.load(AtomicOrdering::Relaxed)
    }

    /// The `type` of this route's problem documents (RFC 9457): `base`
    /// followed by the problem's code (`key-missing`, `key-invalid`,
    /// `key-reused`, `key-in-use`, `request-too-large`, `request-body`,
    /// `response-too-large`, `streaming-response`, `unavailable`,
    /// `internal`), e.g. `https://api.example.com/problems/idempotency#`,
    /// an address you control and document. Default: `about:blank`, as RFC
    /// 9457 allows; every document still carries a precise `title` and the
    /// code as the extension member `code`, for clients to branch on.
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.problems.base = Some(base.into().into());
        self
    }

    /// Requests without a key run normally (in a transaction, nothing
    /// recorded) instead of getting 400.
    pub fn optional(mut self) -> Self {
        self.required = false;
        self
    }

    /// Reads the key from this top-level string field of a JSON body
    /// instead of the `Idempotency-Key` header.
    pub fn key_from_json_field(mut self, field: impl Into<String>) -> Self {
        self.key_source = KeySource::JsonField(field.into());
        self
    }

    /// Largest request body buffered (default 1 MiB); larger gets 413.
    pub fn max_request_bytes(mut self, limit: usize) -> Self {
        self.max_request_bytes = limit;
        self
    }

    /// How to compute the scope from the request, e.g. the authenticated
    /// tenant plus the route. Keys of different scopes never collide.
    pub fn scope(mut self, f: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.scope = Arc::new(f);
        self
    }

    /// Which parts of the request make it "the same request".
    pub fn fingerprint(
        mut self,
        f: impl Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.fingerprint = Arc::new(f);
        self
    }

    /// Wakes this outbox's relays after each commit ([`Outbox::wake`]).
    pub fn outbox(mut self, outbox: Outbox) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// Buffers the request, validates its key, opens a transaction and
    /// claims the key in it. `Err` is the response to send as is: a replay
    /// of the recorded response, or a problem document (400 missing or
    /// invalid key, 413 body too large, 409 key in use, 422 key reused with
    /// another request, 503 database unavailable).
    pub async fn begin(&self, request: Request) -> Result<Idempotent, Response> {
        let (parts, body) = request.into_parts();
        let Some(marker) = parts.extensions.get::<FinishMarker>().cloned() else {
            tracing::error!("idempotent route without the require_finish middleware");
            return Err(problem(
                &self.problems,
                StatusCode::INTERNAL_SERVER_ERROR,
                "route-unguarded",
                "Idempotent route misconfigured",
                "this route lacks the outbox::require_finish middleware; nothing was executed",
            ));
        };
        let body = match read_limited(body, self.max_request_bytes).await {
            Ok(body) => body,
            Err(ReadError::TooLarge(_)) => {
                return Err(problem(
                    &self.problems,
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request-too-large",
                    "Request body too large",
                    &format!(
                        "idempotent requests are buffered; the limit is {} bytes",
                        self.max_request_bytes
                    ),
                ));
            }
            Err(ReadError::Body(e)) => {
                tracing::debug!(error = %e, "idempotent request body unreadable");
                return Err(problem(
                    &self.problems,
                    StatusCode::BAD_REQUEST,
                    "request-body",
                    "Unreadable request body",
                    "the request body could not be read",
                ));
            }
        };
        let key = match self
            .raw_key(&parts, &body)
            .map_err(|e| error_response(&self.problems, &e))?
        {
            Some(raw) => {
                Some(IdempotencyKey::parse(&raw).map_err(|e| error_response(&self.problems, &e))?)
            }
            None if self.required => {
                let detail = match &self.key_source {
                    KeySource::Header => {
                        "this endpoint requires an Idempotency-Key header".to_owned()
                    }
                    KeySource::JsonField(f) => {
                        format!("this endpoint requires an idempotency key in the body field `{f}`")
                    }
                };
                return Err(problem(
                    &self.problems,
                    StatusCode::BAD_REQUEST,
                    "key-missing",
                    "Idempotency key missing",
                    &detail,
                ));
            }
            None => None,
        };
        // Concurrent duplicates queue here, before taking a connection.
        let scope = (self.scope)(&parts);
        let gate = match &key {
            None => None,
            Some(key) => {
                let wait = self.idem.wait_bound();
                let gated = self.gates.enter(format!("{scope}\0{}", key.as_str()), wait);
                match gated.await {
                    Some(gate) => Some(gate),
                    None => {
                        return Err(error_response(
                            &self.problems,
                            &Error::IdempotencyKeyInUse {
                                retry_after: self.idem.retry_after(),
                            },
                        ));
                    }
                }
            }
        };
        let mut tx = self
            .idem
            .pool()
            .begin()
            .await
            .map_err(|e| error_response(&self.problems, &Error::Database(e)))?;
        let claimed = match key {
            None => None,
            Some(key) => {
                let fingerprint = (self.fingerprint)(&parts, &body);
                match self.idem.claim(&mut tx, &scope, &key, fingerprint).await {
                    Ok(Claim::Execute(claimed)) => Some(claimed),
                    Ok(Claim::Replay(recorded)) => {
                        // The claim wrote nothing; end the transaction now.
                        let _ = tx.rollback().await;
                        return Err(replay(recorded));
                    }
                    Err(e) => return Err(error_response(&self.problems, &e)),
                }
            }
        };
        marker.set(FinishState::Begun(self.problems.clone()));
        Ok(Idempotent {
            marker,
            tx,
            claimed,
            parts,
            body,
            idem: self.idem.clone(),
            outbox: self.outbox.clone(),
            problems: self.problems.clone(),
            _gate: gate,
        })
    }

    fn raw_key(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Error> {
        let invalid = |reason| Error::InvalidIdempotencyKey { reason };
        match &self.key_source {
            KeySource::Header => match parts.headers.get(IDEMPOTENCY_KEY) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .map(|s| Some(s.to_owned()))
                    .map_err(|_| invalid("must be visible ASCII characters only")),
            },
            KeySource::JsonField(field) => {
                let value: Option<serde_json::Value> = serde_json::from_slice(body).ok();
                match value.as_ref().and_then(|v| v.get(field)) {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(invalid("must be a JSON string")),
                }
            }
        }
    }
}

/// An idempotent request in progress: the buffered request and the
/// transaction in which its key is claimed.
///
/// Extract it last (it consumes the body), run the business write and
/// enqueue events on [`Idempotent::conn`], then return
/// [`Idempotent::finish`]. Replays, and the 400/409/413/422 answers, are
/// sent by the extractor before the handler runs.
///
/// The recording rule: a response below 500 is recorded and committed with
/// the business write; a 5xx, a panic, or a handler that returns without
/// calling `finish` rolls everything back and records nothing, so a retry
/// executes again. Routes run under [`require_finish`], which turns the
/// response of a handler that did not call `finish` into a 500 (it would
/// otherwise report a success whose writes rolled back); the extractor
/// refuses to run without it.
///
/// ```no_run
/// use axum::extract::{FromRef, State};
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use axum::{Json, Router, routing::post};
/// use outbox::idempotency::{Idempotent, IdempotentRoute};
/// use outbox::{NewEvent, Outbox};
///
/// #[derive(Clone)]
/// struct App { idempotency: IdempotentRoute, outbox: Outbox }
///
/// impl FromRef<App> for IdempotentRoute {
///     fn from_ref(app: &App) -> Self { app.idempotency.clone() }
/// }
///
/// async fn create_order(State(app): State<App>, mut req: Idempotent) -> Response {
///     let order: serde_json::Value = match req.json() { Ok(o) => o, Err(bad) => return bad };
///     let written = async {
///         sqlx::query("INSERT INTO orders (id, body) VALUES ('o-42', $1)").bind(&order).execute(req.conn()).await?;
///         app.outbox.enqueue(req.conn(), NewEvent::new("order", "o-42", "OrderPlaced", &order)?).await?;
///         Ok::<_, outbox::Error>(())
///     }.await;
///     match written {
///         Ok(()) => req.finish((StatusCode::CREATED, Json(serde_json::json!({"id": "o-42"})))).await,
///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(), // rolled back, not recorded
///     }
/// }
///
/// fn router(app: App) -> Router {
///     Router::new()
///         .route("/orders", post(create_order))
///         // Required: a handler returning without `finish` gets a 500.
///         .route_layer(axum::middleware::from_fn(outbox::require_finish))
///         .with_state(app)
/// }
/// ```
pub struct Idempotent {
    marker: FinishMarker,
    tx: Transaction<'static, Postgres>,
    claimed: Option<ClaimedKey>,
    parts: Parts,
    body: Bytes,
    idem: Idempotency,
    outbox: Option<Outbox>,
    problems: ProblemTypes,
    /// Held until the response is recorded and committed (or dropped).
    _gate: Option<Gate>,
}

impl std::fmt::Debug for Idempotent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("key", &self.key())
            .field("method", &self.parts.method)
            .field("uri", &self.parts.uri)
            .finish_non_exhaustive()
    }
}

impl Idempotent {
    /// The transaction holding the claim: write through it (`req.conn()`).
    /// Everything commits with the recorded response in
    /// [`Idempotent::finish`], or rolls back.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The request's method, URI and headers.
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// The buffered request body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body parsed as JSON; `Err` is a 400 problem response (not
    /// recorded unless passed to [`Idempotent::finish`]).
    #[expect(
        clippy::result_large_err,
        reason = "axum handlers return the rejection as their response"
    )]
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, Response> {
        serde_json::from_slice(&self.body).map_err(|e| {
            problem(
                &self.problems,
                StatusCode::BAD_REQUEST,
                "request-body",
                "Invalid JSON body",
                &e.to_string(),
            )
        })
    }

    /// The claimed key; `None` on an optional route called without one.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.claimed.as_ref().map(ClaimedKey::key)
    }

    /// Records `response` (below 500) and commits it with the handler's
    /// writes; returns it to send. A 5xx rolls back and is returned as is.
    /// A streaming body, or one over the recording cap, is refused: rolled
    /// back, not recorded, answered with a 500 problem document.
    pub async fn finish(self, response: impl IntoResponse) -> Response {
        let response = response.into_response();
        self.marker.set(FinishState::Finished);
        let Idempotent {
            mut tx,
            claimed,
            idem,
            outbox,
            problems,
            // Kept to the end: a waiting duplicate must find the record.
            _gate,
            ..
        } = self;
        if response.status().is_server_error() {
            let _ = tx.rollback().await;
            return response;
        }
        let (parts, body) = response.into_parts();
        if body.size_hint().exact().is_none() {
            let _ = tx.rollback().await;
            return problem(
                &problems,
                StatusCode::INTERNAL_SERVER_ERROR,
                "streaming-response",
                "Streaming response on an idempotent route",
                "the response has no known length, so it cannot be recorded; nothing was committed",
            );
        }
        let limit = idem.max_response_bytes();
        let bytes = match read_limited(body, limit).await {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = tx.rollback().await;
                return match e {
                    ReadError::TooLarge(size) => {
                        error_response(&problems, &Error::ResponseTooLarge { size, limit })
                    }
                    ReadError::Body(e) => {
                        tracing::error!(error = %e, "idempotent response body failed");
                        problem(
                            &problems,
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal",
                            "Internal error",
                            "nothing was committed; retry with the same key",
                        )
                    }
                };
            }
        };
        if let Some(claimed) = claimed {
            let recorded = RecordedResponse {
                status: parts.status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                    .collect(),
                body: bytes.to_vec(),
            };
            if let Err(e) = idem.record(&mut tx, claimed, &recorded).await {
                let _ = tx.rollback().await;
                return error_response(&problems, &e);
            }
        }
        if let Err(e) = tx.commit().await {
            return error_response(&problems, &Error::Database(e));
        }
        if let Some(outbox) = outbox {
            outbox.wake();
        }
        Response::from_parts(parts, Body::from(bytes))
    }
}

impl<S> FromRequest<S> for Idempotent
where
    IdempotentRoute: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        IdempotentRoute::from_ref(state).begin(req).await
    }
}

/// A recorded response as sent to a retry.
fn replay(recorded: RecordedResponse) -> Response {
    let mut response = Response::new(Body::from(recorded.body));
    *response.status_mut() =
        StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in recorded.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The HTTP answer to an error of this crate.
fn error_response(problems: &ProblemTypes, e: &Error) -> Response {
    match e {
        Error::InvalidIdempotencyKey { .. } => problem(
            problems,
            StatusCode::BAD_REQUEST,
            "key-invalid",
            "Invalid idempotency key",
            &format!("{e}; use 1 to 255 visible ASCII characters"),
        ),
        Error::IdempotencyKeyMismatch => problem(
            problems,
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "Idempotency key reused",
            "this key was already used with a different request; use a new key for a new request",
        ),
        Error::IdempotencyKeyInUse { retry_after } => with_retry_after(
            problem(
                problems,
                StatusCode::CONFLICT,
                "key-in-use",
                "Request in progress",
                "a request with this idempotency key is still being processed; retry later",
            ),
            *retry_after,
        ),
        Error::ResponseTooLarge { .. } => problem(
            problems,
            StatusCode::INTERNAL_SERVER_ERROR,
            "response-too-large",
            "Response too large to record",
            &format!("{e}; nothing was committed"),
        ),
        e if e.is_transient() => with_retry_after(
            problem(
                problems,
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Service unavailable",
                "the database is unavailable; nothing was committed, retry later",
            ),
            Duration::from_secs(1),
        ),
        e => {
            tracing::error!(error = %e, "idempotent request failed");
            problem(
                problems,
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "nothing was committed; retry with the same key",
            )
        }
    }
}

fn with_retry_after(mut response: Response, after: Duration) -> Response {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    response
}

/// An RFC 9457 problem document.
fn problem(
    problems: &ProblemTypes,
    status: StatusCode,
    code: &str,
    title: &str,
    detail: &str,
) -> Response {
    let body = serde_json::json!({
        "type": problems.uri(code),
        "code": code,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

enum ReadError {
    TooLarge(usize),
    Body(axum::Error),
}

/// Buffers a body, refusing more than `limit` bytes.
async fn read_limited(mut body: Body, limit: usize) -> Result<Bytes, ReadError> {
    let lower = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
    if lower > limit {
        return Err(ReadError::TooLarge(lower));
    }
    let mut buf = Vec::with_capacity(lower);
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame.map_err(ReadError::Body)?.into_data() {
            if buf.len() + data.len() > limit {
                return Err(ReadError::TooLarge(buf.len() + data.len()));
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.into())
}
