//! The inbox statements, built once per schema.

use outbox::Ident;
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

/// The inbox of one schema and consumer name.
#[derive(Debug, Clone)]
pub(crate) struct Inbox {
    consumer: String,
    /// Records a batch of keys; returns those not seen before. Keys are
    /// sorted by the caller so two transactions inserting overlapping sets
    /// take their row locks in the same order (no deadlock). A key's
    /// partition is `inbox_event_time(key)`, a function of the key alone;
    /// records from before migration 3 are looked up in version 1's `inbox`.
    claim: SqlStr,
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
        let s = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            claim: AssertSqlSafe(format!(
                "INSERT INTO {s}.inbox_processed (consumer, event_id, event_at) \
                 SELECT $1, k, {s}.inbox_event_time(k) FROM unnest($2::text[]) AS k \
                 WHERE NOT EXISTS (SELECT 1 FROM {s}.inbox o WHERE o.consumer = $1 AND o.event_id = k) \
                 ON CONFLICT (consumer, event_id, event_at) DO NOTHING \
                 RETURNING event_id"
            ))
            .into_sql_str(),
            forget: AssertSqlSafe(format!(
                "WITH gone AS ( \
                     DELETE FROM {s}.inbox_processed WHERE consumer = $1 AND event_id = ANY($2::text[]) \
                 ) \
                 INSERT INTO {s}.inbox_parked (consumer, event_id, event_at) \
                 SELECT $1, k, {s}.inbox_event_time(k) FROM unnest($2::text[]) AS k \
                 ON CONFLICT (consumer, event_id) DO UPDATE SET parked_at = now()"
            ))
            .into_sql_str(),
        }
    }

    /// Records `sorted_keys` (unique, sorted); returns the fresh ones.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        sorted_keys: &[&str],
    ) -> sqlx::Result<Vec<String>> {
        sqlx::query_scalar(self.claim.clone())
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
