//! Per-test isolation: every test gets its own schema in the test database.
#![allow(dead_code, unreachable_pub)]

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

pub async fn pool() -> PgPool {
    pool_of(8).await
}

async fn pool_of(connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .connect(&database_url())
        .await
        .expect("test database reachable (run `make services`)")
}

/// A fresh schema name, unique per test run and test.
pub fn unique_schema(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("t_{prefix}_{}", &id[..12])
}

/// A pool and a migrated schema of its own.
pub async fn migrated(prefix: &str) -> (PgPool, String) {
    let pool = pool().await;
    let schema = unique_schema(prefix);
    outbox::migrate(&pool, &schema).await.expect("migrate");
    (pool, schema)
}

pub async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await
    .expect("drop schema");
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
    pool_of(1).await
}

/// A transaction on its own connection that has taken its snapshot: it
/// holds the database's xmin horizon (no vacuum, no index-entry killing)
/// until it is dropped.
pub async fn hold_snapshot() -> sqlx::PgConnection {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&database_url())
        .await
        .expect("connect");
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut conn)
        .await
        .expect("snapshot");
    conn
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
