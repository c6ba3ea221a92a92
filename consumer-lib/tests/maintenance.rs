//! Retention cleanup and the version-check helper.

mod common;

use std::time::Duration;

use common::Env;
use outbox_consumer::{DEFAULT_RETENTION, RetentionTask, apply_if_newer, cleanup_inbox};
use sqlx::AssertSqlSafe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_rows_past_the_window() {
    let env = Env::new().await;
    let s = &env.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {s}.inbox (consumer, event_id, processed_at)
         SELECT c, c || '-old-' || i, now() - interval '8 days' FROM unnest(ARRAY['a','b']) c, generate_series(1, 6000) i;
         INSERT INTO {s}.inbox (consumer, event_id, processed_at)
         SELECT c, c || '-young-' || i, now() - interval '6 days 23 hours' FROM unnest(ARRAY['a','b']) c, generate_series(1, 10) i;"
    )))
    .execute(&env.pool)
    .await
    .unwrap();
    // One consumer's rows only, in more than one chunk.
    assert_eq!(
        cleanup_inbox(&env.pool, s, Some("a"), DEFAULT_RETENTION)
            .await
            .unwrap(),
        6000
    );
    assert_eq!(env.count("{s}.inbox WHERE consumer = 'a'").await, 10);
    assert_eq!(env.count("{s}.inbox WHERE consumer = 'b'").await, 6010);
    // Every consumer, through the background service's run_once.
    let task = RetentionTask::new(env.pool.clone(), s.clone(), None);
    assert_eq!(task.run_once().await.unwrap(), 6000);
    assert_eq!(env.count("{s}.inbox").await, 20);
    assert_eq!(
        env.count("{s}.inbox WHERE event_id LIKE '%-old-%'").await,
        0
    );
    // A shorter window reaches the younger rows; nothing is left twice.
    assert_eq!(
        cleanup_inbox(&env.pool, s, None, Duration::from_secs(86_400))
            .await
            .unwrap(),
        20
    );
    assert_eq!(
        cleanup_inbox(&env.pool, s, None, Duration::ZERO)
            .await
            .unwrap(),
        0
    );
    env.teardown().await;
}

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
