//! Example producer: an orders HTTP API on the transactional outbox.
//!
//! `POST /orders` with `{"sku": "A-1", "qty": 2}` and an `Idempotency-Key`
//! header writes the order and its `OrderPlaced` event in **one**
//! transaction, together with the recorded response; a retry with the same
//! key gets that response again and writes nothing. The relay
//! (`outbox-relay`) publishes the events; `examples/inventory` and
//! `examples/notifications` consume them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/shop").await?;
//! let state = orders::setup(&pool, "public").await?; // migrates, creates `orders`
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, orders::router(state)).await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod http;
mod store;

use outbox::idempotency::{Idempotency, IdempotencyConfig, IdempotentRoute};
use sqlx::PgPool;

pub use crate::http::{AppState, router};
pub use crate::store::{AGGREGATE_TYPE, MAX_QTY, NewOrder, ORDER_PLACED, Order, Orders};

/// Prepares `schema` of the producer's database (outbox migrations, the
/// `orders` table if missing; both idempotent) and returns the state the
/// [`router`] serves.
pub async fn setup(pool: &PgPool, schema: &str) -> outbox::Result<AppState> {
    setup_with(pool, schema, outbox::Capture::Table).await
}

/// [`setup`] with the events written as `capture` says (the outbox table,
/// or the write-ahead log: [`outbox::Capture::Wal`]).
pub async fn setup_with(
    pool: &PgPool,
    schema: &str,
    capture: outbox::Capture,
) -> outbox::Result<AppState> {
    let orders = Orders::setup_with(pool, schema, capture).await?;
    let idem = Idempotency::new(pool, {
        let mut c = IdempotencyConfig::default();
        c.schema = schema.to_string();
        c
    })
    .await?;
    let idempotency = IdempotentRoute::new(idem).outbox(orders.outbox().clone());
    Ok(AppState {
        pool: pool.clone(),
        orders,
        idempotency,
    })
}
