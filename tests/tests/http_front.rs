//! The matrix's HTTP front, once per capture mode: the orders example
//! (`examples/orders`, axum with `Idempotency-Key`) in front of the outbox,
//! the relay and a dedup consumer, driven like clients nobody on the
//! project wrote would: malformed bodies (their own 4xx, the key left free),
//! business rejections (recorded, replayed), retries, concurrent
//! duplicates of one key. Judged once quiet: every order placed once, its
//! event applied once, nothing else applied, no rejected request recorded.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDb, amqp_url, database_url, settled_depth, wait_until};
use lapin::types::FieldTable;
use outbox::Capture;
use outbox_consumer::{Consumer, ConsumerConfig};
use outbox_relay::{Relay, RelayConfig, WalCapture};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(120);

/// One `POST /orders` under `key`: status, whether it was replayed, body.
async fn post_order(addr: SocketAddr, key: &str, body: &str) -> (u16, bool, String) {
    let reply = e2e::post_json(addr, "/orders", key, body).await;
    (reply.status, reply.replayed, reply.body)
}

async fn http_front(capture: Capture) {
    let prefix = if capture == Capture::Wal {
        "front_w"
    } else {
        "front_t"
    };
    let db = match capture {
        Capture::Wal => TestDb::producer_wal(prefix).await,
        _ => TestDb::producer(prefix).await,
    };
    let broker = TestBroker::new(prefix, FieldTable::default()).await;
    let wire_queue = format!("{}.wire", broker.queue);
    let conn = e2e::connect().await;
    e2e::declare_tap_queue(
        &conn,
        &broker.exchange,
        &wire_queue,
        "#",
        FieldTable::default(),
    )
    .await;
    let wire = Collector::start(&wire_queue);

    let consumer_schema = format!("{}_c", db.schema);
    outbox_consumer::migrate(&db.pool, &consumer_schema)
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{consumer_schema}\".effects (event_id text NOT NULL)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let start_consumer = || async {
        let mut config = ConsumerConfig::new(amqp_url(), &broker.queue, "front");
        config.schema = consumer_schema.clone();
        config.declare_retry_queues = false;
        let pool = e2e::pool(&format!("c-{}", db.schema), 4).await;
        let effect = e2e::RecordEffect::new(&consumer_schema);
        let consumer = Consumer::new(config, pool, effect).unwrap();
        let stop = CancellationToken::new();
        let s = stop.clone();
        (stop, tokio::spawn(async move { consumer.run(s).await }))
    };
    let (consumer_stop, consumer) = start_consumer().await;

    let mut relay_config = RelayConfig::default();
    relay_config.amqp_url = amqp_url().into();
    relay_config.schema = db.schema.clone();
    relay_config.default_exchange = broker.exchange.clone();
    relay_config.declare_exchange = None;
    relay_config.poll_interval = Duration::from_millis(200);
    if capture == Capture::Wal {
        relay_config.wal = Some(WalCapture::new(database_url()));
    }
    let relay = Relay::new(
        e2e::pool(&format!("r-{}", db.schema), 4).await,
        relay_config,
    )
    .await
    .unwrap();
    let relay_stop = CancellationToken::new();
    let relay_task = tokio::spawn({
        let s = relay_stop.clone();
        async move { relay.run(s).await }
    });

    let state = orders::setup_with(&db.pool, &db.schema, capture)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, orders::router(state)).await });

    // Clients: each key first sent malformed or rejected, then corrected,
    // retried, and some sent twice at once.
    let order = r#"{"sku":"A-1","qty":1}"#;
    let clients = (0..120).map(|i| async move {
        let key = format!("k-{i}");
        let mut placed = None;
        match i % 6 {
            0 => assert_eq!(post_order(addr, &key, "{not json").await.0, 400),
            1 => assert_eq!(
                post_order(addr, &key, r#"{"sku":1,"qty":"x"}"#).await.0,
                422
            ),
            2 => {
                // A business rejection is recorded: its retry gets it again,
                // and the key stays bound to that request.
                let bad = r#"{"sku":"A-1","qty":0}"#;
                assert_eq!(post_order(addr, &key, bad).await.0, 400);
                assert_eq!(post_order(addr, &key, bad).await.0, 400);
                assert_eq!(post_order(addr, &key, order).await.0, 422);
                return None;
            }
            _ => {}
        }
        let (first, second) = if i % 6 == 3 {
            tokio::join!(post_order(addr, &key, order), post_order(addr, &key, order))
        } else {
            let a = post_order(addr, &key, order).await;
            (a, post_order(addr, &key, order).await)
        };
        for (status, _, body) in [&first, &second] {
            if *status == 201 {
                let o: orders::Order = serde_json::from_str(body).unwrap();
                assert!(
                    placed.is_none_or(|p| p == o.event_id),
                    "two orders for {key}"
                );
                placed = Some(o.event_id);
            } else {
                assert_eq!(*status, 409, "{key}: {status} {body}");
            }
        }
        let (status, replayed, body) = post_order(addr, &key, order).await;
        assert_eq!((status, replayed), (201, true), "{key}: {body}");
        let o: orders::Order = serde_json::from_str(&body).unwrap();
        assert_eq!(
            Some(o.event_id),
            placed,
            "{key}: the replay is the recorded order"
        );
        placed
    });
    let placed: Vec<String> = futures_util::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .map(|id| id.to_string())
        .collect();
    assert_eq!(
        placed.len(),
        100,
        "one order per key not rejected by the business rules"
    );
    assert_eq!(db.count("orders").await, 100, "each placed once");

    // Quiet: every event published, the relay stopped, the consumer's
    // queue empty with nothing unacknowledged.
    wait_until(DEADLINE, "every order's event on the wire", || async {
        placed.iter().all(|id| wire.has(id))
    })
    .await;
    relay_stop.cancel();
    relay_task.await.unwrap().unwrap();
    // Empty of ready messages is not enough: the consumer may still hold
    // a prefetched batch unacknowledged, which its stop hands back to the
    // queue (seen: 9 left). Every placed order's effect applied is.
    let effects = format!("SELECT count(*) FROM \"{consumer_schema}\".effects");
    wait_until(
        DEADLINE,
        "every effect applied, the queue empty",
        || async {
            let applied: i64 = sqlx::query_scalar(AssertSqlSafe(effects.clone()))
                .fetch_one(&db.pool)
                .await
                .unwrap();
            applied as usize >= placed.len() && e2e::depth(&conn, &broker.queue).await.0 == 0
        },
    )
    .await;
    consumer_stop.cancel();
    consumer.await.unwrap().unwrap();
    let end = std::time::Instant::now() + DEADLINE;
    assert_eq!(settled_depth(&conn, &broker.queue, end).await, 0);
    wire.drain(DEADLINE).await;
    server.abort();

    let applied: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT event_id FROM \"{consumer_schema}\".effects"
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    e2e::assert_applied_once(&applied, &placed, &format!("HTTP front ({prefix})"));
    assert_eq!(wire.distinct(), placed.len(), "nothing else was published");
    let recorded: HashSet<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT response_status::bigint FROM \"{}\".idempotency_keys",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(
        recorded.is_subset(&HashSet::from([201, 400])),
        "only placed orders and business rejections are recorded: {recorded:?}"
    );
    assert_eq!(
        db.count("idempotency_keys").await,
        120,
        "100 orders and 20 business rejections recorded, no malformed request"
    );
    let _ = conn.close(200, "ok".into()).await;
    wire.stop();
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{consumer_schema}\" CASCADE"
    )))
    .execute(&db.pool)
    .await;
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn matrix_http_front_table() {
    http_front(Capture::Table).await;
}

#[tokio::test]
async fn matrix_http_front_wal() {
    http_front(Capture::Wal).await;
}
