//! Database helpers: which errors are worth retrying, and deleting in
//! chunks.

use sqlx::PgPool;
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;

/// Whether a sqlx error is worth retrying: connection loss, a closed or
/// exhausted pool, serialisation failures, deadlocks, a server shutting
/// down or starting, a lock not available.
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // serialization_failure, deadlock_detected, admin_shutdown,
            // crash_shutdown, cannot_connect_now, lock_not_available
            Some("40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03")
        ),
        _ => false,
    }
}

/// Runs a chunked `DELETE` until a chunk deletes fewer than `chunk` rows,
/// and returns how many rows it deleted in all. `statement` builds the
/// statement for one chunk, given the chunk size to bind as its `LIMIT`
/// (`DELETE FROM t WHERE ctid = ANY(ARRAY(SELECT ctid FROM t WHERE ...
/// LIMIT $n))`), so cleanup never holds long locks or builds one huge
/// transaction.
pub async fn delete_in_chunks<'q, F>(
    pool: &PgPool,
    chunk: i64,
    mut statement: F,
) -> sqlx::Result<u64>
where
    F: FnMut(i64) -> Query<'q, Postgres, PgArguments>,
{
    let mut total = 0;
    loop {
        let n = statement(chunk).execute(pool).await?.rows_affected();
        total += n;
        if n < chunk as u64 {
            return Ok(total);
        }
    }
}
