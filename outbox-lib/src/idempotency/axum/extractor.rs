//! The [`Idempotent`] extractor: begin (buffer the request, claim its key
//! in a new transaction), then [`Idempotent::finish`] (record the
//! response, commit).

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, Postgres, Transaction};

use super::IDEMPOTENT_REPLAYED;
use super::body::{ReadError, read_limited};
use super::finish::{FinishMarker, FinishState};
use super::gate::Gate;
use super::problem::{ProblemTypes, error_response, internal_error, problem};
use super::route::IdempotentRoute;
use crate::error::Error;
use crate::idempotency::atomic::{Claim, ClaimedKey};
use crate::idempotency::handle::Idempotency;
use crate::idempotency::key::IdempotencyKey;
use crate::idempotency::store::RecordedResponse;
use crate::outbox::Outbox;

/// An idempotent request in progress: the buffered request and the
/// transaction in which its key is claimed.
///
/// It consumes the body: extract it after the extractors that do not read
/// the body (`State`, `Path`, `Query`, headers), and run those that do
/// (`Json`, `Form`, your own) on the buffered request with
/// [`Idempotent::extract`]. Run the business write and enqueue events on
/// [`Idempotent::conn`], then return [`Idempotent::finish`]. Replays, and
/// this extractor's own answers (400 key missing or invalid, 409 key in
/// use, 413 body too large, 422 key reused), are sent before the handler
/// runs.
///
/// The recording rule:
///
/// * [`Idempotent::finish`] records a response below 500 and commits it with
///   the business write; a deliberate rejection passed to it is replayed
///   like a success, so a retry cannot turn it into one. A 5xx passed to it
///   rolls back and is not recorded.
/// * Returning without `finish` (or panicking) rolls everything back and
///   records nothing: the key is free again. A 4xx or 5xx is sent as is;
///   that is how a request rejected before the work (the rejection of
///   [`Idempotent::extract`]) is answered, and the same key with a
///   corrected request then executes once. A response below 400 would
///   report a success whose writes rolled back: [`require_finish`], which
///   every idempotent route runs under, replaces it with a 500
///   (`handler-unfinished`); the extractor refuses to run without it.
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
/// async fn create_order(State(app): State<App>, mut req: Idempotent) -> Result<Response, Response> {
///     // Not JSON, or not an order: axum's own 4xx, nothing recorded.
///     let Json(order): Json<serde_json::Value> = req.extract().await?;
///     let written = async {
///         sqlx::query("INSERT INTO orders (id, body) VALUES ('o-42', $1)").bind(&order).execute(req.conn()).await?;
///         app.outbox.enqueue(req.conn(), NewEvent::new("order", "o-42", "OrderPlaced", &order)?).await?;
///         Ok::<_, outbox::Error>(())
///     }.await;
///     match written {
///         Ok(()) => Ok(req.finish((StatusCode::CREATED, Json(serde_json::json!({"id": "o-42"})))).await),
///         Err(_) => Err(StatusCode::INTERNAL_SERVER_ERROR.into_response()), // rolled back, not recorded
///     }
/// }
///
/// fn router(app: App) -> Router {
///     Router::new()
///         .route("/orders", post(create_order))
///         // Required: a handler returning a success without `finish` gets a 500.
///         .route_layer(axum::middleware::from_fn(outbox::idempotency::require_finish))
///         .with_state(app)
/// }
/// ```
///
/// [`require_finish`]: super::require_finish
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
    /// [`IdempotentRoute::begin`].
    pub(super) async fn begin(
        route: &IdempotentRoute,
        request: Request,
    ) -> Result<Idempotent, Response> {
        let (parts, body) = request.into_parts();
        let Some(marker) = parts.extensions.get::<FinishMarker>().cloned() else {
            tracing::error!("idempotent route without the require_finish middleware");
            return Err(problem(
                route.problems(),
                StatusCode::INTERNAL_SERVER_ERROR,
                "route-unguarded",
                "Idempotent route misconfigured",
                "this route lacks the outbox::idempotency::require_finish middleware; nothing was executed",
            ));
        };
        let body = route.buffer(body).await?;
        let key = route.key(&parts, &body)?;
        // Concurrent duplicates queue here, before taking a connection.
        let scope = route.scope_of(&parts);
        let gate = match &key {
            None => None,
            Some(key) => Some(route.enter_gate(&scope, key).await?),
        };
        let mut tx = route
            .idem()
            .pool()
            .begin()
            .await
            .map_err(|e| error_response(route.problems(), &Error::Database(e)))?;
        let claimed = match key {
            None => None,
            Some(key) => {
                let fingerprint = route.fingerprint_of(&parts, &body);
                match route.idem().claim(&mut tx, &scope, &key, fingerprint).await {
                    Ok(Claim::Execute(claimed)) => Some(claimed),
                    Ok(Claim::Replay(recorded)) => {
                        // The claim wrote nothing; end the transaction now.
                        let _ = tx.rollback().await;
                        return Err(replay(recorded));
                    }
                    Err(e) => return Err(error_response(route.problems(), &e)),
                }
            }
        };
        marker.set(FinishState::Begun(route.problems().clone()));
        Ok(Idempotent {
            marker,
            tx,
            claimed,
            parts,
            body,
            idem: route.idem().clone(),
            outbox: route.woken().cloned(),
            problems: route.problems().clone(),
            _gate: gate,
        })
    }

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

    /// The body parsed as JSON; `Err` is a 400 problem document. Returned
    /// without [`Idempotent::finish`], it is not recorded and the key is
    /// released. Unlike axum's `Json` (see [`Idempotent::extract`]), it
    /// does not require a JSON `Content-Type`.
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

    /// Runs the axum extractor `E` (`Json<T>`, `Form<T>`, `Query<T>`,
    /// `Path<T>`, your own `FromRequest` or `FromRequestParts`) on the
    /// buffered request; it may run any number of extractors, in any order.
    /// `Err` is the extractor's own rejection as a response (for `Json`:
    /// 400 not JSON, 415 not a JSON `Content-Type`, 422 wrong types, 413
    /// over the route's `DefaultBodyLimit`). Return it without
    /// [`Idempotent::finish`]: nothing is recorded and the key is released,
    /// so the same key with a corrected request executes once. An extractor
    /// that needs the application state: [`Idempotent::extract_with_state`].
    pub async fn extract<E, M>(&self) -> Result<E, Response>
    where
        E: FromRequest<(), M>,
    {
        self.extract_with_state(&()).await
    }

    /// [`Idempotent::extract`] for an extractor that reads `state`.
    pub async fn extract_with_state<E, S, M>(&self, state: &S) -> Result<E, Response>
    where
        E: FromRequest<S, M>,
        S: Send + Sync,
    {
        // Cheap: the parts are small and the body is shared, not copied.
        let request = Request::from_parts(self.parts.clone(), Body::from(self.body.clone()));
        E::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)
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
        let limit = idem.config().max_response_bytes;
        let bytes = match read_limited(body, limit).await {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = tx.rollback().await;
                return unrecordable(&problems, e, limit);
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

/// The answer to a response whose body cannot be recorded: over `limit`
/// bytes, or failing.
fn unrecordable(problems: &ProblemTypes, e: ReadError, limit: usize) -> Response {
    match e {
        ReadError::TooLarge(size) => {
            error_response(problems, &Error::ResponseTooLarge { size, limit })
        }
        ReadError::Body(e) => {
            tracing::error!(error = %e, "idempotent response body failed");
            internal_error(problems)
        }
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
