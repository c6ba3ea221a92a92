//! The effect every end-to-end consumer applies: deliberately not
//! idempotent, so the oracle sees a double application.

use outbox_consumer::{Event, Handler, Outcome};
use sqlx::{AssertSqlSafe, PgConnection};

/// A per-event handler that inserts one row per application into
/// `<schema>.effects` (no unique key on `event_id`, so an event applied
/// twice leaves two rows; [`assert_applied_once`](crate::assert_applied_once)
/// judges them).
pub struct RecordEffect {
    insert: String,
    retry_first: bool,
}

impl RecordEffect {
    /// Rows go to `"<schema>".effects (event_id)`.
    pub fn new(schema: &str) -> Self {
        Self {
            insert: format!("INSERT INTO \"{schema}\".effects (event_id) VALUES ($1)"),
            retry_first: false,
        }
    }

    /// Every event's first attempt asks for a retry instead (the retry
    /// queue in the path of every event).
    pub fn retry_first(mut self) -> Self {
        self.retry_first = true;
        self
    }
}

impl Handler for RecordEffect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        if self.retry_first && event.retry_count() == 0 {
            return Outcome::retry("the first attempt asks for a retry");
        }
        match sqlx::query(AssertSqlSafe(self.insert.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            // A deadlock or serialization failure runs the batch again
            // (`Outcome::Conflict`); anything else is retried.
            Err(e) => e.into(),
        }
    }
}
