//! The version-check helper (retention: `retention.rs`).

use e2e::consumer::Env;
use outbox_consumer::apply_if_newer;
use sqlx::AssertSqlSafe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_if_newer_ignores_stale_and_repeated_versions() {
    let env = Env::new().await;
    let s = &env.schema;
    let mut conn = env.pool.acquire().await.unwrap();
    let mut v = async |consumer: &str, entity: &str, version: i64| {
        apply_if_newer(&mut conn, s, consumer, entity, version)
            .await
            .unwrap()
    };
    assert!(v("c", "customer:1", 1).await, "first version applies");
    assert!(
        !v("c", "customer:1", 1).await,
        "repeated version is a no-op"
    );
    assert!(v("c", "customer:1", 3).await, "newer applies");
    assert!(!v("c", "customer:1", 2).await, "stale is a no-op");
    assert!(v("c", "customer:2", 1).await, "entities are independent");
    assert!(
        v("other", "customer:1", 2).await,
        "consumers are independent"
    );
    let stored: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {s}.inbox_versions WHERE consumer = 'c' AND entity = 'customer:1'"
    )))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(stored, 3);
    // Rolled back with the caller's transaction.
    let mut tx = env.pool.begin().await.unwrap();
    assert!(
        apply_if_newer(&mut tx, s, "c", "customer:1", 9)
            .await
            .unwrap()
    );
    tx.rollback().await.unwrap();
    assert!(!v("c", "customer:1", 3).await);
    drop(conn);
    env.teardown().await;
}
