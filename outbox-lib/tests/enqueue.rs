//! The write side against a real PostgreSQL.

use e2e::TestDb;
use outbox::{Error, NewEvent, Outbox, OutboxConfig, Wakeup};
use serde_json::json;
use sqlx::Row;

async fn outbox(pool: &sqlx::PgPool, schema: &str) -> Outbox {
    Outbox::new(pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.wakeup = Wakeup::PollOnly;
        c
    })
    .await
    .expect("outbox")
}

#[tokio::test]
async fn committed_event_has_every_contract_column() {
    let db = TestDb::producer("commit").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema).await;
    let mut tx = pool.begin().await.unwrap();
    let event = NewEvent::new(
        "order",
        "o-1",
        "OrderPlaced",
        &json!({"sku": "A-1", "qty": 2}),
    )
    .unwrap()
    .header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
    .exchange("orders")
    .routing_key("orders.placed");
    let id = outbox.enqueue(&mut *tx, event).await.unwrap();
    tx.commit().await.unwrap();

    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                created_at, available_at, attempts, last_error, error_history
         FROM \"{schema}\".outbox"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<uuid::Uuid, _>("id"), id);
    assert_eq!(id.get_version_num(), 7);
    assert_eq!(row.get::<String, _>("aggregate_type"), "order");
    assert_eq!(row.get::<String, _>("aggregate_id"), "o-1");
    assert_eq!(row.get::<String, _>("event_type"), "OrderPlaced");
    assert_eq!(
        row.get::<serde_json::Value, _>("payload"),
        json!({"sku": "A-1", "qty": 2})
    );
    assert_eq!(
        row.get::<serde_json::Value, _>("headers"),
        json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    );
    assert_eq!(
        row.get::<Option<String>, _>("exchange").as_deref(),
        Some("orders")
    );
    assert_eq!(
        row.get::<Option<String>, _>("routing_key").as_deref(),
        Some("orders.placed")
    );
    let created: chrono::DateTime<chrono::Utc> = row.get("created_at");
    assert!((chrono::Utc::now() - created).num_seconds().abs() < 60);
    // Due from the moment the row was written (migration 15), within its
    // transaction, which began at `created_at`.
    let available: chrono::DateTime<chrono::Utc> = row.get("available_at");
    assert!(
        available >= created && available - created < chrono::TimeDelta::seconds(10),
        "available_at {available} vs created_at {created}"
    );
    assert_eq!(row.get::<i32, _>("attempts"), 0);
    assert_eq!(row.get::<Option<String>, _>("last_error"), None);
    assert_eq!(row.get::<serde_json::Value, _>("error_history"), json!([]));
    db.cleanup().await;
}

#[tokio::test]
async fn rolled_back_transaction_leaves_nothing() {
    let db = TestDb::producer("rollback").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema).await;
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // A dropped (never committed) transaction rolls back too.
    {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(
                &mut *tx,
                NewEvent::new("order", "o-2", "OrderPlaced", &json!({})).unwrap(),
            )
            .await
            .unwrap();
    }
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn enqueue_many_writes_a_thousand_events_in_one_statement() {
    let db = TestDb::producer("many").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema).await;
    let mut tx = pool.begin().await.unwrap();
    // A first statement, so the batch cannot be command 0 by accident.
    outbox
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "first", "E", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    let events: Vec<_> = (0..1000)
        .map(|i| NewEvent::new("order", format!("o-{i}"), "OrderPlaced", &json!({"i": i})).unwrap())
        .collect();
    let expected: Vec<_> = events.iter().map(NewEvent::id).collect();
    let ids = outbox.enqueue_many(&mut *tx, events).await.unwrap();
    assert_eq!(ids, expected, "ids come back in input order");
    tx.commit().await.unwrap();

    // Every statement in a transaction gets its own command id (cmin): one
    // distinct cmin over the 1,000 rows means one statement wrote them.
    let (rows, commands): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT cmin::text) FROM \"{schema}\".outbox WHERE aggregate_id <> 'first'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((rows, commands), (1000, 1));
    db.cleanup().await;
}

#[tokio::test]
async fn deterministic_id_enqueued_twice_yields_one_event() {
    let db = TestDb::producer("detid").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema).await;
    let make = |qty: i32| {
        NewEvent::new("payment", "p-9", "PaymentCaptured", &json!({"qty": qty}))
            .unwrap()
            .id_from_key("stripe-ch_123")
    };
    let mut first = None;
    for qty in [1, 2] {
        let mut tx = pool.begin().await.unwrap();
        let id = outbox.enqueue(&mut *tx, make(qty)).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(*first.get_or_insert(id), id);
    }
    // Twice in one call too.
    let mut tx = pool.begin().await.unwrap();
    let ids = outbox
        .enqueue_many(&mut *tx, [make(3), make(4)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids, vec![first.unwrap(); 2]);

    let payloads: Vec<serde_json::Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT payload FROM \"{schema}\".outbox"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(payloads, vec![json!({"qty": 1})], "the first write wins");
    db.cleanup().await;
}

#[tokio::test]
async fn bad_input_gets_a_typed_error_and_writes_nothing() {
    let db = TestDb::producer("bad").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let mut config = OutboxConfig::default();
    config.schema = schema.to_string();
    config.wakeup = Wakeup::PollOnly;
    config.max_payload_bytes = 64;
    let outbox = Outbox::new(&pool, config).await.unwrap();
    let ok = || NewEvent::new("order", "o-1", "E", &json!({})).unwrap();
    type Case = (NewEvent, fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        (NewEvent::new("", "o-1", "E", &json!({})).unwrap(), |e| {
            matches!(
                e,
                Error::EmptyField {
                    field: "aggregate_type"
                }
            )
        }),
        (NewEvent::new("order", "", "E", &json!({})).unwrap(), |e| {
            matches!(
                e,
                Error::EmptyField {
                    field: "aggregate_id"
                }
            )
        }),
        (
            NewEvent::new("order", "o-1", " ", &json!({})).unwrap(),
            |e| {
                matches!(
                    e,
                    Error::EmptyField {
                        field: "event_type"
                    }
                )
            },
        ),
        (
            NewEvent::new("order", "o-1", "E", &"x".repeat(100)).unwrap(),
            |e| {
                matches!(
                    e,
                    Error::PayloadTooLarge {
                        size: 102,
                        limit: 64
                    }
                )
            },
        ),
    ];
    for (bad, is_expected) in cases {
        let mut tx = pool.begin().await.unwrap();
        // A valid event beside the bad one: the whole call must write nothing.
        let err = outbox
            .enqueue_many(&mut *tx, [ok(), bad])
            .await
            .unwrap_err();
        assert!(is_expected(&err), "unexpected error {err:?}");
        // The transaction is still usable: nothing was sent to the database.
        tx.commit().await.unwrap();
    }
    assert!(matches!(
        ok().headers(&json!(["not", "an", "object"])),
        Err(Error::HeadersNotObject { found: "an array" })
    ));
    assert!(matches!(
        NewEvent::from_json("order", "o-1", "E", "{oops"),
        Err(Error::InvalidJson(_))
    ));
    for bad_schema in ["Bad-Schema", "x; DROP TABLE outbox", ""] {
        let err = Outbox::new(&pool, {
            let mut c = OutboxConfig::default();
            c.schema = bad_schema.to_string();
            c
        })
        .await
        .unwrap_err();
        assert!(
            matches!(err, Error::InvalidIdentifier { what: "schema", .. }),
            "{err:?}"
        );
        let err = outbox::migrate(&pool, bad_schema).await.unwrap_err();
        assert!(matches!(err, Error::InvalidIdentifier { .. }), "{err:?}");
    }
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn migrating_twice_is_a_no_op() {
    let db = TestDb::empty("mig").await;
    let other_db = TestDb::empty("mig2").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let first = outbox::migrate(&pool, &schema).await.unwrap();
    assert_eq!(first, (1..=17).collect::<Vec<i32>>());
    let second = outbox::migrate(&pool, &schema).await.unwrap();
    assert!(second.is_empty());
    // Concurrent runs are serialised too.
    let other = other_db.schema.clone();
    let (a, b) = tokio::join!(
        outbox::migrate(&pool, &other),
        outbox::migrate(&pool, &other)
    );
    let mut applied = [a.unwrap(), b.unwrap()];
    applied.sort();
    assert_eq!(applied, [vec![], (1..=17).collect::<Vec<i32>>()]);
    db.cleanup().await;
    other_db.cleanup().await;
}

#[tokio::test]
async fn unmigrated_database_names_the_fix() {
    let db = TestDb::empty("nomig").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let err = Outbox::new(&pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c
    })
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Migration(outbox::MigrateError::NotMigrated { found: 0, .. })
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("outbox-relay migrate"), "{message}");
    assert!(message.contains(&schema), "{message}");
    db.cleanup().await;
}

#[tokio::test]
async fn wakeup_after_commit_notifies_listeners_outside_the_transaction() {
    let db = TestDb::producer("wake").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = Outbox::new(&pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c
    })
    .await
    .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener
        .listen(&outbox::wakeup_channel(
            &outbox::Ident::new("schema", &schema).unwrap(),
        ))
        .await
        .unwrap();

    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-1", "E", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    outbox.commit(tx).await.unwrap();
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv())
        .await
        .expect("a wake-up within the deadline")
        .unwrap();
    assert_eq!(n.channel(), format!("outbox_{schema}"));
    db.cleanup().await;
}

#[tokio::test]
async fn wakeup_in_transaction_notifies_on_commit_only() {
    let db = TestDb::producer("wakeintx").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let mut config = OutboxConfig::default();
    config.schema = schema.to_string();
    config.wakeup = Wakeup::InTransaction;
    let outbox = Outbox::new(&pool, config).await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(&format!("outbox_{schema}")).await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-1", "E", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-2", "E", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv())
        .await
        .expect("a wake-up within the deadline")
        .unwrap();
    assert_eq!(n.channel(), format!("outbox_{schema}"));
    db.cleanup().await;
}

#[tokio::test]
async fn a_plain_sql_insert_gets_the_documented_defaults() {
    // What a producer in another language does: only the required columns.
    let db = TestDb::producer("rawsql").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'o-1', 'OrderPlaced', '{{\"sku\":\"A-1\"}}')
         RETURNING id, headers, exchange, routing_key, attempts, available_at <= clock_timestamp() AS due"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let id: uuid::Uuid = row.get("id");
    assert_eq!(id.get_version_num(), 7, "default ids are UUIDv7");
    let ts = id.get_timestamp().unwrap().to_unix().0 as i64;
    assert!(
        (chrono::Utc::now().timestamp() - ts).abs() < 60,
        "v7 carries the current time"
    );
    assert_eq!(row.get::<serde_json::Value, _>("headers"), json!({}));
    assert_eq!(row.get::<Option<String>, _>("exchange"), None);
    assert_eq!(row.get::<Option<String>, _>("routing_key"), None);
    assert_eq!(row.get::<i32, _>("attempts"), 0);
    assert!(row.get::<bool, _>("due"));
    // The table itself refuses what the library refuses.
    for bad in [
        "('', 'o', 'E', '{}', '{}')",
        "('order', 'o', 'E', '{}', '[]')",
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES {bad}"
        )))
        .execute(&pool)
        .await
        .unwrap_err();
        assert!(err.to_string().contains("check constraint"), "{err}");
    }
    db.cleanup().await;
}
