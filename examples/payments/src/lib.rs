//! A payments service on the transactional outbox: the code that
//! `docs/GETTING_STARTED.md` walks through.
//!
//! `POST /payments` with an `Idempotency-Key` writes a payment and its
//! `payment.captured` event in **one** transaction ([`capture`]); a retry
//! with the same key gets the recorded answer and writes nothing. The
//! relay (`outbox-relay run`) publishes the event; the [`Ledger`] consumer
//! credits each captured payment to its account once, however often it is
//! delivered. The outbox, the inbox and the service's tables share one
//! schema ([`migrate`]).
#![deny(missing_docs)]

mod api;
mod ledger;

pub use crate::api::{NewPayment, Payment, capture, outbox, router};
pub use crate::ledger::{LEDGER_QUEUE, Ledger, ledger_config, ledger_topology};

use outbox::sqlx::PgPool;

/// The service's own tables. Unqualified: they go to the first schema of
/// the connection's `search_path`, `public` by default, and a test
/// schema's in tests.
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS payments (
    id           uuid PRIMARY KEY,
    account      text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0)
);
CREATE TABLE IF NOT EXISTS ledger (
    account       text PRIMARY KEY,
    balance_cents bigint NOT NULL,
    entries       integer NOT NULL
);";

/// Prepares `schema` (idempotent): the producer's tables (outbox,
/// idempotency keys), the consumer's (inbox), then the service's own.
pub async fn migrate(pool: &PgPool, schema: &str) -> Result<(), outbox_consumer::Error> {
    outbox::migrate(pool, schema).await?;
    outbox_consumer::migrate(pool, schema).await?;
    outbox::sqlx::raw_sql(TABLES).execute(pool).await?;
    Ok(())
}
