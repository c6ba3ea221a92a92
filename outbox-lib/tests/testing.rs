//! The `testing` feature's helpers: a test's own schema, created and
//! dropped (by `cleanup`, and by `Drop` even behind an open transaction),
//! and the events a transaction enqueued, read back.

use outbox::testing::{TestSchema, enqueued};
use outbox::{NewEvent, Outbox, OutboxConfig};
use sqlx::PgPool;

async fn schema_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_test_schema_is_first_on_the_search_path_and_dropped_by_cleanup() {
    let outside = e2e::pool("outbox-lib-test", 8).await;
    let db = TestSchema::create(&e2e::database_url()).await.unwrap();
    let name = db.name().to_owned();
    assert!(name.starts_with("t_"), "{name}");
    assert!(schema_exists(&outside, &name).await);
    // Unqualified SQL lands in the test's schema.
    sqlx::query("CREATE TABLE things (id int)")
        .execute(db.pool())
        .await
        .unwrap();
    let table: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{name}.things"))
        .fetch_one(&outside)
        .await
        .unwrap();
    assert!(table.is_some(), "things is not in {name}");
    db.cleanup().await.unwrap();
    assert!(!schema_exists(&outside, &name).await);
}

#[tokio::test]
async fn a_dropped_test_schema_goes_even_behind_an_open_transaction() {
    let outside = e2e::pool("outbox-lib-test", 8).await;
    let db = TestSchema::create(&e2e::database_url()).await.unwrap();
    let name = db.name().to_owned();
    sqlx::query("CREATE TABLE things (id int)")
        .execute(db.pool())
        .await
        .unwrap();
    // What a panicking test leaves: a transaction holding a lock on the
    // schema's table, never rolled back.
    let mut tx = db.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO things VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    std::mem::forget(tx);
    drop(db);
    assert!(!schema_exists(&outside, &name).await);
}

#[tokio::test]
async fn enqueued_reads_what_a_transaction_wrote_and_nothing_it_rolled_back() {
    let db = TestSchema::create(&e2e::database_url()).await.unwrap();
    outbox::migrate(db.pool(), db.name()).await.unwrap();
    let mut config = OutboxConfig::default();
    config.schema = db.name().to_owned();
    let outbox = Outbox::new(db.pool(), config).await.unwrap();

    let mut tx = db.pool().begin().await.unwrap();
    let first = NewEvent::new(
        "payment",
        "p-1",
        "captured",
        &serde_json::json!({"cents": 5}),
    )
    .unwrap()
    .header("traceparent", "00-ab-cd-01")
    .routing_key("payments.captured");
    let first_id = outbox.enqueue(&mut *tx, first).await.unwrap();
    let second = NewEvent::from_json("payment", "p-1", "refunded", "[1, 2]").unwrap();
    let second_id = outbox.enqueue(&mut *tx, second).await.unwrap();
    // The transaction sees its own events; no one else does yet.
    let seen = enqueued(&mut *tx, db.name()).await.unwrap();
    assert!(enqueued(db.pool(), db.name()).await.unwrap().is_empty());
    assert_eq!(
        seen.iter().map(|e| e.id).collect::<Vec<_>>(),
        [first_id, second_id]
    );
    let e = &seen[0];
    assert_eq!(
        (
            e.aggregate_type.as_str(),
            e.aggregate_id.as_str(),
            e.event_type.as_str()
        ),
        ("payment", "p-1", "captured")
    );
    assert_eq!(e.payload, serde_json::json!({"cents": 5}));
    assert_eq!(e.payload_as::<serde_json::Value>().unwrap()["cents"], 5);
    assert_eq!(e.headers["traceparent"], "00-ab-cd-01");
    assert_eq!(e.routing_key.as_deref(), Some("payments.captured"));
    assert_eq!((e.exchange.as_deref(), e.aggregate_seq), (None, None));
    assert_eq!(seen[1].payload, serde_json::json!([1, 2]));
    tx.commit().await.unwrap();
    assert_eq!(enqueued(db.pool(), db.name()).await.unwrap(), seen);

    let mut tx = db.pool().begin().await.unwrap();
    let third = NewEvent::from_json("payment", "p-2", "captured", "{}").unwrap();
    outbox.enqueue(&mut *tx, third).await.unwrap();
    assert_eq!(enqueued(&mut *tx, db.name()).await.unwrap().len(), 3);
    tx.rollback().await.unwrap();
    assert_eq!(enqueued(db.pool(), db.name()).await.unwrap(), seen);
    db.cleanup().await.unwrap();
}
