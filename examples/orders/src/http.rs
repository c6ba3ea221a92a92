//! The HTTP API: `POST /orders` (idempotent), `GET /orders/{id}`,
//! `GET /healthz`.

use axum::extract::{FromRef, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use outbox::idempotency::{Idempotent, IdempotentRoute};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::store::{NewOrder, Orders};

/// What the handlers share. Built by [`crate::setup`]; cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(crate) pool: PgPool,
    pub(crate) orders: Orders,
    pub(crate) idempotency: IdempotentRoute,
}

impl AppState {
    /// The orders store, for writing orders outside HTTP (e.g. in tests).
    pub fn orders(&self) -> &Orders {
        &self.orders
    }
}

impl FromRef<AppState> for IdempotentRoute {
    fn from_ref(app: &AppState) -> Self {
        app.idempotency.clone()
    }
}

/// The service's routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        // Every idempotent route: a handler that forgot `finish` cannot
        // send a success its rolled-back transaction does not back (its
        // 4xx and 5xx go out as they are).
        .route_layer(axum::middleware::from_fn(
            outbox::idempotency::require_finish,
        ))
        .route("/orders/{id}", get(show_order))
        .route("/healthz", get(healthz))
        .with_state(state)
}

/// Places an order. Retries with the same `Idempotency-Key` get the
/// recorded answer (`Idempotent-Replayed: true`); the order and its event
/// are written once.
async fn create_order(
    State(app): State<AppState>,
    mut req: Idempotent,
) -> Result<Response, Response> {
    // Not an order (not JSON, wrong types, not a JSON content type): axum's
    // own 4xx, not recorded, so the key serves the corrected request.
    let Json(order): Json<NewOrder> = req.extract().await?;
    if let Err(why) = order.validate() {
        // A business rejection: recorded, so a retry cannot turn it into
        // a success.
        let rejection = (StatusCode::BAD_REQUEST, Json(json!({ "error": why })));
        return Ok(req.finish(rejection).await);
    }
    match app.orders.place(req.conn(), &order).await {
        Ok(placed) => {
            let location = format!("/orders/{}", placed.id);
            let created = (
                StatusCode::CREATED,
                [(header::LOCATION, location)],
                Json(placed),
            );
            // Records the response and commits it with the order and event.
            Ok(req.finish(created).await)
        }
        Err(e) => {
            // Dropping `req` rolls back: nothing recorded, a retry executes.
            tracing::error!(error = %e, "placing an order failed");
            let body = json!({ "error": "the order could not be placed; retry with the same key" });
            Err((StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response())
        }
    }
}

async fn show_order(State(app): State<AppState>, Path(id): Path<Uuid>) -> Response {
    match app.orders.find(&app.pool, id).await {
        Ok(Some(order)) => Json(order).into_response(),
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reading an order failed");
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

async fn healthz(State(app): State<AppState>) -> Response {
    match sqlx::query("SELECT 1").execute(&app.pool).await {
        Ok(_) => (StatusCode::OK, "ok").into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "database unreachable").into_response(),
    }
}
