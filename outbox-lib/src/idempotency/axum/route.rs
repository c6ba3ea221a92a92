//! The settings of idempotent routes, and what a route reads of a request
//! before its key is claimed: the buffered body, the key, the gate.

use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::Response;

use super::IDEMPOTENCY_KEY;
use super::body::{ReadError, read_limited};
use super::extractor::Idempotent;
use super::gate::{Gate, Gates};
use super::problem::{ProblemTypes, error_response, problem};
use crate::error::Error;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::handle::Idempotency;
use crate::idempotency::key::IdempotencyKey;
use crate::outbox::Outbox;

/// Default largest request body an idempotent route buffers: 1 MiB.
const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

type ScopeFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

/// Where a route reads its key.
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
///
/// [`Idempotent`]: super::Idempotent
/// [`FromRef`]: axum::extract::FromRef
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
        Idempotent::begin(self, request).await
    }

    /// The handle whose table holds this route's keys.
    pub(super) fn idem(&self) -> &Idempotency {
        &self.idem
    }

    /// The outbox whose relays are woken after each commit, if any.
    pub(super) fn woken(&self) -> Option<&Outbox> {
        self.outbox.as_ref()
    }

    /// How this route's problem documents are typed.
    pub(super) fn problems(&self) -> &ProblemTypes {
        &self.problems
    }

    /// The scope of a request.
    pub(super) fn scope_of(&self, parts: &Parts) -> String {
        (self.scope)(parts)
    }

    /// The fingerprint of a request.
    pub(super) fn fingerprint_of(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        (self.fingerprint)(parts, body)
    }

    /// The request body, buffered up to `max_request_bytes`; `Err` is a
    /// 413 (too large) or 400 (unreadable) problem response.
    pub(super) async fn buffer(&self, body: Body) -> Result<Bytes, Response> {
        match read_limited(body, self.max_request_bytes).await {
            Ok(body) => Ok(body),
            Err(ReadError::TooLarge(_)) => Err(problem(
                &self.problems,
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-too-large",
                "Request body too large",
                &format!(
                    "idempotent requests are buffered; the limit is {} bytes",
                    self.max_request_bytes
                ),
            )),
            Err(ReadError::Body(e)) => {
                tracing::debug!(error = %e, "idempotent request body unreadable");
                Err(problem(
                    &self.problems,
                    StatusCode::BAD_REQUEST,
                    "request-body",
                    "Unreadable request body",
                    "the request body could not be read",
                ))
            }
        }
    }

    /// The request's key, validated; `None` on an optional route called
    /// without one. `Err` is a 400 problem response (missing or invalid).
    #[expect(
        clippy::result_large_err,
        reason = "the rejection is the response begin returns as is"
    )]
    pub(super) fn key(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Option<IdempotencyKey>, Response> {
        match self
            .raw_key(parts, body)
            .map_err(|e| error_response(&self.problems, &e))?
        {
            Some(raw) => Ok(Some(
                IdempotencyKey::parse(&raw).map_err(|e| error_response(&self.problems, &e))?,
            )),
            None if self.required => {
                let detail = match &self.key_source {
                    KeySource::Header => {
                        "this endpoint requires an Idempotency-Key header".to_owned()
                    }
                    KeySource::JsonField(f) => {
                        format!("this endpoint requires an idempotency key in the body field `{f}`")
                    }
                };
                Err(problem(
                    &self.problems,
                    StatusCode::BAD_REQUEST,
                    "key-missing",
                    "Idempotency key missing",
                    &detail,
                ))
            }
            None => Ok(None),
        }
    }

    /// Waits (up to the wait bound) for the gate of `key` in `scope`;
    /// `Err` is a 409 problem response: still in use.
    pub(super) async fn enter_gate(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Gate, Response> {
        let wait = self.idem.config().wait;
        let gated = self.gates.enter(format!("{scope}\0{}", key.as_str()), wait);
        match gated.await {
            Some(gate) => Ok(gate),
            None => Err(error_response(
                &self.problems,
                &Error::IdempotencyKeyInUse {
                    retry_after: self.idem.config().retry_after,
                },
            )),
        }
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
