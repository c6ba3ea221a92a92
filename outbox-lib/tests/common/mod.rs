//! Per-test isolation: every test gets its own schema in the test database.
#![allow(dead_code, unreachable_pub)]

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

pub async fn pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
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
