//! The [`require_finish`] middleware, and the marker through which it
//! learns whether the handler finished.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::Response;

use super::problem::{ProblemTypes, problem};

/// What became of the idempotent request of one HTTP request; shared by
/// [`require_finish`] and the extractor through the request extensions.
#[derive(Debug, Clone, Default)]
pub(super) struct FinishMarker(Arc<std::sync::Mutex<FinishState>>);

#[derive(Debug, Default)]
pub(super) enum FinishState {
    /// No idempotent request was begun.
    #[default]
    Unused,
    /// Begun (a transaction is open), not finished yet.
    Begun(ProblemTypes),
    /// [`Idempotent::finish`](super::Idempotent::finish) was called.
    Finished,
}

impl FinishMarker {
    pub(super) fn set(&self, state: FinishState) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }
}

/// axum middleware that every idempotent route runs under. A handler that
/// returns without [`Idempotent::finish`] has had its transaction rolled
/// back (its writes and its claim are gone, nothing is recorded), so:
///
/// * a response below 400 would tell the client that writes happened which
///   did not: it is replaced by a 500 problem document
///   (`handler-unfinished`), logged as an error;
/// * a 4xx (a request rejected before the work, e.g. the rejection of
///   [`Idempotent::extract`]) or a 5xx is sent as is: it does not claim a
///   success, and the key is free again, so the same key with a corrected
///   request executes once. Logged at debug.
///
/// The [`Idempotent`] extractor refuses to run on a route without it (500,
/// `route-unguarded`), so the mistake shows on the first request.
///
/// ```no_run
/// # use axum::{Router, routing::post, response::Response};
/// # use outbox::idempotency::IdempotentRoute;
/// # async fn create_order(req: outbox::idempotency::Idempotent) -> Response { unimplemented!() }
/// # fn router(route: IdempotentRoute) -> Router {
/// Router::new()
///     .route("/orders", post(create_order))
///     .route_layer(axum::middleware::from_fn(outbox::idempotency::require_finish))
///     .with_state(route)
/// # }
/// ```
///
/// [`Idempotent`]: super::Idempotent
/// [`Idempotent::finish`]: super::Idempotent::finish
/// [`Idempotent::extract`]: super::Idempotent::extract
pub async fn require_finish(mut request: Request, next: axum::middleware::Next) -> Response {
    let marker = FinishMarker::default();
    request.extensions_mut().insert(marker.clone());
    let response = next.run(request).await;
    let state = std::mem::take(&mut *marker.0.lock().unwrap_or_else(|p| p.into_inner()));
    match state {
        FinishState::Begun(problems) if claims_success(response.status()) => {
            tracing::error!(
                status = %response.status(),
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
        FinishState::Begun(_) => {
            tracing::debug!(
                status = %response.status(),
                "idempotent request answered without finish: rolled back, not recorded, key released"
            );
            response
        }
        FinishState::Unused | FinishState::Finished => response,
    }
}

/// Whether a response tells the client its request was carried out (below
/// 400): only [`Idempotent::finish`](super::Idempotent::finish) may send
/// one, since only it commits the writes behind it.
fn claims_success(status: StatusCode) -> bool {
    status.as_u16() < 400
}
