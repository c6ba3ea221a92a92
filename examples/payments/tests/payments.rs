//! The payments service's tests, as docs/GETTING_STARTED.md writes them:
//! against a real PostgreSQL, each test in a schema of its own, no
//! RabbitMQ and no relay (the `testing` features of outbox and
//! outbox-consumer).

use outbox::testing::{TestSchema, enqueued};
use outbox_consumer::testing::{Delivered, EventBuilder, TestConsumer};
use payments::{Ledger, NewPayment, Payment};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A fresh schema, migrated as the service migrates its own.
async fn test_schema() -> TestSchema {
    let url = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let db = TestSchema::create(&url).await.expect("the test database");
    payments::migrate(db.pool(), db.name())
        .await
        .expect("migrate");
    db
}

/// The ledger consumer, driven by the test (its AMQP URL is not used).
fn ledger(db: &TestSchema) -> TestConsumer {
    let config = payments::ledger_config("amqp://unused", db.name());
    TestConsumer::new(config, db.pool().clone(), Ledger).expect("a valid configuration")
}

fn captured(account: &str, amount_cents: i64) -> EventBuilder {
    let payment = Payment {
        id: uuid::Uuid::now_v7(),
        account: account.into(),
        amount_cents,
    };
    EventBuilder::new("captured")
        .aggregate("payment", payment.id.to_string())
        .payload(&payment)
}

async fn balance(db: &TestSchema, account: &str) -> Option<(i64, i32)> {
    outbox::sqlx::query_as("SELECT balance_cents, entries FROM ledger WHERE account = $1")
        .bind(account)
        .fetch_optional(db.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_payment_and_its_event_commit_together() {
    let db = test_schema().await;
    let outbox = payments::outbox(db.pool(), db.name()).await.unwrap();
    let new = NewPayment {
        account: "acme".into(),
        amount_cents: 1250,
    };

    let mut tx = db.pool().begin().await.unwrap();
    let payment = payments::capture(&outbox, &mut *tx, new).await.unwrap();
    // What the relay will publish once this transaction commits:
    let events = enqueued(&mut *tx, db.name()).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].aggregate_type, "payment");
    assert_eq!(events[0].event_type, "captured");
    assert_eq!(events[0].aggregate_id, payment.id.to_string());
    assert_eq!(events[0].payload_as::<Payment>().unwrap(), payment);

    // Rolled back: neither the payment nor its event.
    tx.rollback().await.unwrap();
    assert!(enqueued(db.pool(), db.name()).await.unwrap().is_empty());
    let payments: i64 = outbox::sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(payments, 0);
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_retried_request_captures_once() {
    let db = test_schema().await;
    let api = payments::router(db.pool(), db.name()).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { outbox::axum::serve(listener, api).await });

    let body = r#"{"account": "acme", "amount_cents": 1250}"#;
    let (status, _, first) = post(&addr, "key-1", body).await;
    assert_eq!(status, 201);
    // The client did not hear back and retries with the same key.
    let (status, head, retry) = post(&addr, "key-1", body).await;
    assert_eq!(status, 201);
    assert_eq!(retry, first);
    assert!(head.contains("idempotent-replayed: true"));
    // One payment, one event.
    assert_eq!(enqueued(db.pool(), db.name()).await.unwrap().len(), 1);

    // A rejection is recorded too; another key is another payment.
    let (status, _, _) = post(&addr, "key-2", r#"{"account": "acme", "amount_cents": 0}"#).await;
    assert_eq!(status, 422);
    let (status, _, _) = post(&addr, "key-3", body).await;
    assert_eq!(status, 201);
    assert_eq!(enqueued(db.pool(), db.name()).await.unwrap().len(), 2);
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn the_ledger_credits_each_payment_once() {
    let db = test_schema().await;
    let ledger = ledger(&db);
    let event = captured("acme", 1250).build();

    assert_eq!(ledger.deliver(&event).await.unwrap(), Delivered::Applied);
    // The broker delivers it again (a crash before the ack, a republish):
    assert_eq!(ledger.deliver(&event).await.unwrap(), Delivered::Duplicate);
    assert_eq!(balance(&db, "acme").await, Some((1250, 1)));

    // Two payments and a copy in one batch: each credited once.
    let (a, b) = (captured("acme", 100).build(), captured("acme", 10).build());
    let delivered = ledger.deliver_batch(&[a.clone(), b, a]).await.unwrap();
    assert_eq!(
        delivered,
        [Delivered::Applied, Delivered::Applied, Delivered::Duplicate]
    );
    assert_eq!(balance(&db, "acme").await, Some((1360, 3)));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn the_ledgers_outcomes() {
    let db = test_schema().await;
    let ledger = ledger(&db);

    // Not a payment: dead-lettered, nothing credited.
    let garbage = EventBuilder::new("captured")
        .body(r#"{"cents": "many"}"#)
        .build();
    assert_eq!(
        ledger.deliver(&garbage).await.unwrap(),
        Delivered::DeadLettered {
            reason: "payload is not a payment".into()
        }
    );
    // Another payment event: acked, nothing to credit.
    let refunded = EventBuilder::new("refunded").build();
    assert_eq!(ledger.deliver(&refunded).await.unwrap(), Delivered::Applied);
    assert_eq!(balance(&db, "acme").await, None);

    // A database error (the balance would overflow): retried later...
    let full = captured("acme", i64::MAX).build();
    assert_eq!(ledger.deliver(&full).await.unwrap(), Delivered::Applied);
    let more = captured("acme", 1);
    let delivered = ledger.deliver(&more.clone().build()).await.unwrap();
    assert!(
        matches!(&delivered, Delivered::Retried { attempt: 1, reason, .. } if reason.contains("out of range")),
        "{delivered:?}"
    );
    // ... until its retries are spent (5 by default): then dead-lettered.
    let last_try = more.retry_count(5).build();
    assert!(matches!(
        ledger.deliver(&last_try).await.unwrap(),
        Delivered::DeadLettered { reason } if reason.starts_with("gave up after 5 retries")
    ));
    assert_eq!(balance(&db, "acme").await, Some((i64::MAX, 1)));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn from_request_to_ledger_without_a_broker() {
    let db = test_schema().await;
    let outbox = payments::outbox(db.pool(), db.name()).await.unwrap();
    for amount_cents in [500, 700] {
        let mut tx = db.pool().begin().await.unwrap();
        let new = NewPayment {
            account: "acme".into(),
            amount_cents,
        };
        payments::capture(&outbox, &mut *tx, new).await.unwrap();
        outbox.commit(tx).await.unwrap();
    }
    // What the relay would publish, delivered to the consumer.
    let ledger = ledger(&db);
    for event in enqueued(db.pool(), db.name()).await.unwrap() {
        let event = EventBuilder::from(&event).build();
        assert_eq!(ledger.deliver(&event).await.unwrap(), Delivered::Applied);
    }
    assert_eq!(balance(&db, "acme").await, Some((1200, 2)));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn one_schema_holds_the_producer_the_consumer_and_the_service() {
    let db = test_schema().await;
    for table in [
        "outbox",
        "idempotency_keys",
        "inbox",
        "inbox_sequences",
        "payments",
        "ledger",
    ] {
        let found: Option<String> = outbox::sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(format!("{}.{table}", db.name()))
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert!(found.is_some(), "{table} is not in {}", db.name());
    }
    // Both migration sets recorded side by side; running them again is a no-op.
    assert!(
        outbox::migrate(db.pool(), db.name())
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        outbox_consumer::migrate(db.pool(), db.name())
            .await
            .unwrap()
            .is_empty()
    );
    outbox::check_migrated(db.pool(), db.name()).await.unwrap();
    db.cleanup().await.unwrap();
}

/// `POST /payments` with an `Idempotency-Key`, over a plain connection:
/// the status, the head (lower case) and the body.
async fn post(addr: &str, key: &str, body: &str) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /payments HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_owned())
}
