//! Deleting inbox records older than the retention window.
//!
//! The rule: the window must exceed every horizon within which a message
//! can come back (broker redelivery, the retry queue's longest backoff
//! times the retries, dead-letter replay, producer-side relay retries). A
//! record deleted earlier lets a late duplicate apply its effect twice.

use std::time::Duration;

use outbox::Ident;
use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr};
use tokio_util::sync::CancellationToken;

use crate::error::Result;

/// Default retention window: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Rows deleted per statement, so cleanup never holds long locks or builds
/// one huge transaction.
const CHUNK: i64 = 5_000;

/// Deletes inbox records of `consumer` (every consumer when `None`) whose
/// `processed_at` is older than `older_than`, in chunks. Returns how many
/// it deleted. Version records (`inbox_versions`) are state and are kept.
pub async fn cleanup_inbox(
    pool: &PgPool,
    schema: &str,
    consumer: Option<&str>,
    older_than: Duration,
) -> Result<u64> {
    let s = Ident::new("schema", schema)?.quoted();
    let sql = format!(
        "DELETE FROM {s}.inbox WHERE ctid = ANY(ARRAY(
             SELECT ctid FROM {s}.inbox
             WHERE processed_at < now() - make_interval(secs => $1)
               AND ($2::text IS NULL OR consumer = $2)
             LIMIT $3))"
    );
    let sql = AssertSqlSafe(sql).into_sql_str();
    let total = outbox_core::db::delete_in_chunks(pool, CHUNK, |chunk| {
        sqlx::query(sql.clone())
            .bind(older_than.as_secs_f64())
            .bind(consumer)
            .bind(chunk)
    })
    .await?;
    if total > 0 {
        tracing::info!(schema, consumer, deleted = total, "inbox retention cleanup");
    }
    metrics::counter!("outbox_consumer_inbox_deleted_total").increment(total);
    Ok(total)
}

/// A background service running [`cleanup_inbox`] periodically.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetentionTask {
    pool: PgPool,
    schema: String,
    consumer: Option<String>,
    /// Records older than this are deleted. Default [`DEFAULT_RETENTION`].
    pub window: Duration,
    /// Pause between runs. Default 1 hour.
    pub interval: Duration,
}

impl RetentionTask {
    /// Cleanup of `schema`'s inbox (one consumer's records, or all).
    pub fn new(pool: PgPool, schema: impl Into<String>, consumer: Option<String>) -> Self {
        Self {
            pool,
            schema: schema.into(),
            consumer,
            window: DEFAULT_RETENTION,
            interval: Duration::from_secs(3600),
        }
    }

    /// One cleanup pass.
    pub async fn run_once(&self) -> Result<u64> {
        cleanup_inbox(
            &self.pool,
            &self.schema,
            self.consumer.as_deref(),
            self.window,
        )
        .await
    }

    /// Runs a pass every `interval` until `shutdown`. Errors are logged and
    /// the next pass tries again.
    pub async fn run(&self, shutdown: CancellationToken) {
        loop {
            if let Err(e) = self.run_once().await {
                tracing::warn!(error = %e, schema = %self.schema, "inbox retention cleanup failed; will retry");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
