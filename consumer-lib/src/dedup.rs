//! The inbox statements, built once per schema.

use outbox::Ident;
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

/// The inbox of one schema and consumer name.
#[derive(Debug, Clone)]
pub(crate) struct Inbox {
    consumer: String,
    /// Records a batch of keys; returns those not seen before. Keys are
    /// sorted by the caller so two transactions inserting overlapping sets
    /// take their row locks in the same order (no deadlock).
    claim: SqlStr,
    /// Removes the records of events whose handler did not succeed, so
    /// their redelivery runs again. Also the last statement before COMMIT:
    /// it fails if the transaction is aborted, where COMMIT would silently
    /// roll back.
    forget: SqlStr,
}

impl Inbox {
    pub(crate) fn new(schema: &Ident, consumer: &str) -> Self {
        let s = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            claim: AssertSqlSafe(format!(
                "INSERT INTO {s}.inbox (consumer, event_id) \
                 SELECT $1, k FROM unnest($2::text[]) AS k \
                 ON CONFLICT (consumer, event_id) DO NOTHING \
                 RETURNING event_id"
            ))
            .into_sql_str(),
            forget: AssertSqlSafe(format!(
                "DELETE FROM {s}.inbox WHERE consumer = $1 AND event_id = ANY($2::text[])"
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
