//! What the producer's tests add to the workspace's one harness (`e2e`):
//! a schema per test is `e2e::TestDb`; here, reads of a schema's tables
//! and its statistics.
#![allow(dead_code, unreachable_pub, unused_imports)]

pub use e2e::{TestDb, database_url};
use sqlx::PgPool;

/// A pool on the test database, outside any test's schema.
pub async fn pool() -> PgPool {
    e2e::pool("outbox-lib-test", 8).await
}

pub async fn count(pool: &PgPool, schema: &str, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".{table}"
    )))
    .fetch_one(pool)
    .await
    .expect("count")
}

/// A pool of one connection: every statement runs in the same backend, so
/// its statistics can be flushed on demand ([`scans`]).
pub async fn single_pool() -> PgPool {
    e2e::pool("outbox-lib-test-single", 1).await
}

/// A transaction on its own connection that has taken its snapshot: it
/// holds the database's xmin horizon (no vacuum, no index-entry killing)
/// until it is dropped.
pub async fn hold_snapshot() -> sqlx::PgConnection {
    e2e::hold_snapshot(&database_url().parse().expect("TEST_DATABASE_URL")).await
}

/// `table`'s sequential scans and the index entries its indexes returned,
/// after `pool`'s one backend has flushed its statistics.
pub async fn scans(pool: &PgPool, schema: &str, table: &str) -> (i64, i64) {
    // The flush happens when the backend goes idle after this statement;
    // the next statement on the same backend starts after it.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .expect("flush");
    sqlx::query_as(
        "SELECT t.seq_scan, coalesce(sum(i.idx_tup_read), 0)::bigint
         FROM pg_stat_user_tables t LEFT JOIN pg_stat_user_indexes i ON i.relid = t.relid
         WHERE t.schemaname = $1 AND t.relname = $2 GROUP BY t.seq_scan",
    )
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .expect("scans")
}
