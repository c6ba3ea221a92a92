//! The producer: `POST /payments` behind an `Idempotency-Key`.

use outbox::axum::extract::{FromRef, State};
use outbox::axum::http::StatusCode;
use outbox::axum::response::{IntoResponse, Response};
use outbox::axum::{Json, Router, middleware, routing::post};
use outbox::idempotency::{Idempotency, IdempotencyConfig, Idempotent, IdempotentRoute};
use outbox::sqlx::{PgConnection, PgPool};
use outbox::{NewEvent, Outbox, OutboxConfig};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment as a client asks for it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewPayment {
    /// The account credited.
    pub account: String,
    /// The amount, in cents; positive.
    pub amount_cents: i64,
}

/// A captured payment: the answer to the client and the event's payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    /// The payment id, also the event's aggregate id.
    pub id: Uuid,
    /// The account credited.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// Writes the payment and its `payment.captured` event through `conn`,
/// the caller's transaction: both commit, or neither.
pub async fn capture(
    outbox: &Outbox,
    conn: &mut PgConnection,
    new: NewPayment,
) -> outbox::Result<Payment> {
    let payment = Payment {
        id: Uuid::now_v7(),
        account: new.account,
        amount_cents: new.amount_cents,
    };
    outbox::sqlx::query("INSERT INTO payments (id, account, amount_cents) VALUES ($1, $2, $3)")
        .bind(payment.id)
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(&mut *conn)
        .await?;
    // Published as `payment.captured` (`<aggregate_type>.<event_type>`).
    let event = NewEvent::new("payment", payment.id.to_string(), "captured", &payment)?;
    outbox.enqueue(conn, event).await?;
    Ok(payment)
}

/// The outbox of `schema` (migrated before: [`crate::migrate`]).
pub async fn outbox(pool: &PgPool, schema: &str) -> outbox::Result<Outbox> {
    let mut config = OutboxConfig::default();
    config.schema = schema.to_owned();
    Outbox::new(pool, config).await
}

#[derive(Clone)]
struct App {
    outbox: Outbox,
    idempotency: IdempotentRoute,
}

impl FromRef<App> for IdempotentRoute {
    fn from_ref(app: &App) -> Self {
        app.idempotency.clone()
    }
}

/// The HTTP API: `POST /payments`, an `Idempotency-Key` required.
pub async fn router(pool: &PgPool, schema: &str) -> outbox::Result<Router> {
    let outbox = outbox(pool, schema).await?;
    let mut config = IdempotencyConfig::default();
    config.schema = schema.to_owned();
    let keys = Idempotency::new(pool, config).await?;
    // `.outbox(..)`: the relay is woken as soon as a payment commits.
    let idempotency = IdempotentRoute::new(keys).outbox(outbox.clone());
    Ok(Router::new()
        .route("/payments", post(create_payment))
        .route_layer(middleware::from_fn(outbox::idempotency::require_finish))
        .with_state(App {
            outbox,
            idempotency,
        }))
}

async fn create_payment(State(app): State<App>, mut req: Idempotent) -> Result<Response, Response> {
    // Not a payment: axum's own 4xx, nothing recorded, the key stays free.
    let Json(new): Json<NewPayment> = req.extract().await?;
    if new.amount_cents <= 0 {
        // A business rejection: recorded, a retry gets the same answer.
        let rejected = (
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_cents must be positive",
        );
        return Ok(req.finish(rejected).await);
    }
    match capture(&app.outbox, req.conn(), new).await {
        // Records the response; commits it with the payment and its event.
        Ok(payment) => Ok(req.finish((StatusCode::CREATED, Json(payment))).await),
        // Dropping `req` rolls back: nothing recorded, a retry executes.
        Err(_) => Err(StatusCode::SERVICE_UNAVAILABLE.into_response()),
    }
}
