//! `TestBroker` cleans up after itself: the exchange and queue go when the
//! last owner does, a panicking test's included, and `cleanup` and the
//! drop do not get in each other's way.

use e2e::TestBroker;
use lapin::Connection;
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

/// Whether `exchange` and `queue` exist (passive declares, each on a
/// channel of its own: a missing one closes its channel).
async fn exist(conn: &Connection, exchange: &str, queue: &str) -> (bool, bool) {
    let ch = conn.create_channel().await.unwrap();
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let x = ch
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            passive,
            FieldTable::default(),
        )
        .await
        .is_ok();
    let ch = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let q = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok();
    (x, q)
}

fn names(b: &TestBroker) -> (String, String) {
    (b.exchange.clone(), b.queue.clone())
}

#[tokio::test]
async fn a_panicking_test_leaves_neither_its_exchange_nor_its_queue() {
    let test = tokio::spawn(async {
        let broker = TestBroker::new("broker_panics", FieldTable::default()).await;
        std::panic::panic_any(names(&broker));
    });
    let panic = test.await.unwrap_err().into_panic();
    let (exchange, queue) = *panic.downcast::<(String, String)>().unwrap();
    let conn = e2e::connect().await;
    assert_eq!(
        exist(&conn, &exchange, &queue).await,
        (false, false),
        "{exchange} and {queue} are gone"
    );
    let _ = conn.close(200, "ok".into()).await;
}

#[tokio::test]
async fn the_names_go_with_the_last_clone_and_cleanup_is_not_repeated() {
    let conn = e2e::connect().await;
    let broker = TestBroker::new("broker_clones", FieldTable::default()).await;
    let (exchange, queue) = names(&broker);
    let clone = broker.clone();
    drop(broker);
    assert_eq!(
        exist(&conn, &exchange, &queue).await,
        (true, true),
        "a clone still owns them"
    );
    drop(clone);
    assert_eq!(exist(&conn, &exchange, &queue).await, (false, false));

    // Cleaned up explicitly, then dropped: nothing left, nothing fails.
    let broker = TestBroker::new("broker_cleanup", FieldTable::default()).await;
    let (exchange, queue) = names(&broker);
    broker.cleanup().await;
    assert_eq!(exist(&conn, &exchange, &queue).await, (false, false));

    // Built from names (as a test that declares its own topology does):
    // those names are deleted too.
    let made = TestBroker::new("broker_literal", FieldTable::default()).await;
    let (exchange, queue) = names(&made);
    made.cleanup().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.as_str().into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    drop(TestBroker {
        exchange: exchange.clone(),
        queue: queue.clone(),
    });
    assert_eq!(exist(&conn, &exchange, &queue).await, (false, false));
    let _ = conn.close(200, "ok".into()).await;
}
