//! The inbox statements, built once per schema.

use outbox::Ident;
use outbox_core::sql::render;
use sqlx::{PgConnection, SqlStr};

/// The inbox of one schema and consumer name.
#[derive(Debug, Clone)]
pub(crate) struct Inbox {
    consumer: String,
    /// Records a batch of keys; returns those not seen before. Keys are
    /// sorted by the caller so two transactions inserting overlapping sets
    /// take their row locks in the same order (no deadlock). A key's
    /// partition is `inbox_event_time(key)`, a function of the key alone;
    /// records from before migration 3 are looked up in version 1's `inbox`.
    record: SqlStr,
    /// Removes the records of events whose handler did not succeed, so
    /// their redelivery runs again, and parks them: a copy of each is on
    /// its way to the retry or dead-letter queue, and retention keeps what
    /// that copy could meet. Also the last statement before COMMIT: it
    /// fails if the transaction is aborted, where COMMIT would silently
    /// roll back.
    forget: SqlStr,
}

impl Inbox {
    pub(crate) fn new(schema: &Ident, consumer: &str) -> Self {
        Self {
            consumer: consumer.to_owned(),
            record: render(include_str!("inbox/record.sql"), schema),
            forget: render(include_str!("inbox/forget.sql"), schema),
        }
    }

    /// Records `sorted_keys` (unique, sorted); returns the fresh ones.
    pub(crate) async fn record(
        &self,
        conn: &mut PgConnection,
        sorted_keys: &[&str],
    ) -> sqlx::Result<Vec<String>> {
        sqlx::query_scalar(self.record.clone())
            .bind(&self.consumer)
            .bind(sorted_keys)
            .fetch_all(conn)
            .await
    }

    pub(crate) async fn forget(&self, conn: &mut PgConnection, keys: &[&str]) -> sqlx::Result<()> {
        sqlx::query(self.forget.clone())
            .bind(&self.consumer)
            .bind(keys)
            .execute(conn)
            .await?;
        Ok(())
    }
}
