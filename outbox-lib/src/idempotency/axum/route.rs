//! The settings of idempotent routes.

use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;

use axum::body::Bytes;
use axum::http::request::Parts;

use super::gate::Gates;
use super::problem::ProblemTypes;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::store::Idempotency;
use crate::outbox::Outbox;

/// Default largest request body an idempotent route buffers: 1 MiB.
const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

type ScopeFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

/// Where a route reads its key.
#[derive(Debug, Clone)]
pub(super) enum KeySource {
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
    pub(super) idem: Idempotency,
    pub(super) key_source: KeySource,
    pub(super) required: bool,
    pub(super) max_request_bytes: usize,
    pub(super) scope: ScopeFn,
    pub(super) fingerprint: FingerprintFn,
    pub(super) outbox: Option<Outbox>,
    pub(super) problems: ProblemTypes,
    pub(super) gates: Gates,
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
}
