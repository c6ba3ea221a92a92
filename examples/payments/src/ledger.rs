//! The consumer: each captured payment credited to its account, once.

use outbox_consumer::sqlx::PgConnection;
use outbox_consumer::{ConsumerConfig, Event, Handler, Outcome, TopologyConfig};

use crate::Payment;

/// The ledger's queue.
pub const LEDGER_QUEUE: &str = "payments.ledger";

/// Credits each captured payment to its account's balance.
#[derive(Debug)]
pub struct Ledger;

impl Handler for Ledger {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        if event.event_type() != Some("captured") {
            return Outcome::Ack; // another payment event: nothing to credit
        }
        let Ok(payment) = event.payload::<Payment>() else {
            return Outcome::reject("payload is not a payment"); // to the DLQ
        };
        // Not idempotent: the inbox, in this transaction, runs it once.
        let credited = outbox_consumer::sqlx::query(
            "INSERT INTO ledger (account, balance_cents, entries) VALUES ($1, $2, 1)
             ON CONFLICT (account) DO UPDATE
             SET balance_cents = ledger.balance_cents + $2, entries = ledger.entries + 1",
        )
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(conn)
        .await;
        match credited {
            Ok(_) => Outcome::Ack,
            // A deadlock reruns the batch at once; other errors: a retry.
            Err(e) => e.into(),
        }
    }
}

/// The ledger's consumer: its queue, its consumer name (the inbox
/// deduplicates per name), the schema of its inbox.
pub fn ledger_config(amqp_url: &str, schema: &str) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(amqp_url, LEDGER_QUEUE, "ledger");
    config.schema = schema.to_owned();
    config
}

/// The ledger's queue bound to the relay's exchange with `payment.#`,
/// with its retry queue and dead-letter queue.
pub fn ledger_topology() -> TopologyConfig {
    TopologyConfig::new(LEDGER_QUEUE, "outbox.events", "payment.#")
}
