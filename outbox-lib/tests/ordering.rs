//! Per-aggregate sequence numbers on the write side, against a real
//! PostgreSQL.

use std::time::Duration;

use e2e::TestDb;
use outbox::{NewEvent, OrderedAggregates, Outbox, OutboxConfig, Wakeup};
use serde_json::json;

/// Orders in the database what `ordering` names (an operator's step), then
/// builds a handle that checks it.
async fn outbox(pool: &sqlx::PgPool, schema: &str, ordering: OrderedAggregates) -> Outbox {
    let types: Vec<String> = match &ordering {
        OrderedAggregates::All => vec![outbox::ALL_TYPES.to_owned()],
        OrderedAggregates::Types(t) => t.iter().cloned().collect(),
        _ => Vec::new(),
    };
    for t in types {
        outbox::set_ordered(pool, schema, &t, true).await.unwrap();
    }
    Outbox::new(pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.wakeup = Wakeup::PollOnly;
        c.ordering = ordering;
        c
    })
    .await
    .expect("outbox")
}

fn event(agg: &str, id: &str, n: i64) -> NewEvent {
    NewEvent::new(agg, id, "Changed", &json!({ "n": n })).unwrap()
}

/// (aggregate_type, aggregate_id, payload n, aggregate_seq) of every row.
async fn rows(pool: &sqlx::PgPool, schema: &str) -> Vec<(String, String, i64, Option<i64>)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT aggregate_type, aggregate_id, (payload->>'n')::bigint, aggregate_seq
         FROM \"{schema}\".outbox ORDER BY aggregate_type, aggregate_id, (payload->>'n')::bigint"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn ordered_types_are_numbered_per_aggregate_and_others_are_not() {
    let db = TestDb::producer("ord_types").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::types(["order"])).await;
    let mut tx = pool.begin().await.unwrap();
    for n in 1..=3 {
        outbox
            .enqueue(&mut *tx, event("order", "a", n))
            .await
            .unwrap();
        outbox
            .enqueue(&mut *tx, event("order", "b", n))
            .await
            .unwrap();
        outbox
            .enqueue(&mut *tx, event("cart", "a", n))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let got = rows(&pool, &schema).await;
    for (t, a, n, seq) in got {
        match t.as_str() {
            "order" => assert_eq!(seq, Some(n), "{t}/{a} #{n}"),
            _ => assert_eq!(seq, None, "{t}/{a} is not ordered"),
        }
    }
    db.cleanup().await;
}

#[tokio::test]
async fn enqueue_many_numbers_in_input_order_and_continues_the_sequence() {
    let db = TestDb::producer("ord_many").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 1))
        .await
        .unwrap();
    let batch: Vec<NewEvent> = (2..=101)
        .flat_map(|n| [event("order", "a", n), event("order", "b", n - 1)])
        .collect();
    let ids = outbox.enqueue_many(&mut *tx, batch).await.unwrap();
    assert_eq!(ids.len(), 200);
    tx.commit().await.unwrap();
    for (t, a, n, seq) in rows(&pool, &schema).await {
        assert_eq!(seq, Some(n), "{t}/{a} #{n}");
    }
    db.cleanup().await;
}

#[tokio::test]
async fn a_repeated_id_takes_no_number_and_leaves_no_hole() {
    let db = TestDb::producer("ord_dup").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let mut tx = pool.begin().await.unwrap();
    let first = event("order", "a", 1).id_from_key("k1");
    outbox.enqueue(&mut *tx, first.clone()).await.unwrap();
    // Same id again, alone and inside a batch.
    outbox.enqueue(&mut *tx, first.clone()).await.unwrap();
    outbox
        .enqueue_many(&mut *tx, [first, event("order", "a", 2)])
        .await
        .unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 3))
        .await
        .unwrap();
    // The same new id twice in one call: one row, one number.
    let twice = event("order", "a", 4).id_from_key("k4");
    outbox
        .enqueue_many(&mut *tx, [twice.clone(), twice, event("order", "a", 5)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let got: Vec<Option<i64>> = rows(&pool, &schema)
        .await
        .into_iter()
        .map(|r| r.3)
        .collect();
    assert_eq!(got, vec![Some(1), Some(2), Some(3), Some(4), Some(5)]);
    let last: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT last_seq FROM \"{schema}\".outbox_sequences"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(last, 5, "the counter has no hole either");
    db.cleanup().await;
}

#[tokio::test]
async fn a_rolled_back_transaction_gives_its_numbers_back() {
    let db = TestDb::producer("ord_rollback").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 1))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rows(&pool, &schema).await[0].3, Some(1));
    db.cleanup().await;
}

/// Concurrent writers of one aggregate: numbers follow commit order, so a
/// writer that holds its transaction open makes the other wait.
#[tokio::test]
async fn numbers_follow_commit_order_across_concurrent_writers() {
    let db = TestDb::producer("ord_concurrent").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let writers = 8;
    let per_writer = 25;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..per_writer {
                let mut tx = pool.begin().await.unwrap();
                outbox
                    .enqueue(&mut *tx, event("order", "hot", (w * 1000 + i) as i64))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seqs: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT aggregate_seq FROM \"{schema}\".outbox ORDER BY aggregate_seq"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: Vec<i64> = (1..=(writers * per_writer) as i64).collect();
    assert_eq!(seqs, expected, "gapless, one number per event");
    // Commit order: the counter's row lock is held until commit, so a
    // second writer of the aggregate waits and takes the next number.
    let mut a = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut *a, event("order", "hot", -1))
        .await
        .unwrap();
    let second = {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        tokio::spawn(async move {
            let mut b = pool.begin().await.unwrap();
            outbox
                .enqueue(&mut *b, event("order", "hot", -2))
                .await
                .unwrap();
            b.commit().await.unwrap();
        })
    };
    // The second writer is seen waiting on a lock (not merely slow).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
        )
        .bind(&schema)
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second writer never waited on a lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !second.is_finished(),
        "a second writer of the aggregate waits for the first to commit"
    );
    a.commit().await.unwrap();
    second.await.unwrap();
    let last: Vec<(i64, Option<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT (payload->>'n')::bigint, aggregate_seq FROM \"{schema}\".outbox
         WHERE (payload->>'n')::bigint < 0 ORDER BY aggregate_seq"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let n = (writers * per_writer) as i64;
    assert_eq!(last, vec![(-1, Some(n + 1)), (-2, Some(n + 2))]);
    db.cleanup().await;
}

#[tokio::test]
async fn sql_producers_get_numbers_from_the_documented_function() {
    let db = TestDb::producer("ord_sql").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let mut tx = pool.begin().await.unwrap();
    let last: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT \"{schema}\".outbox_next_seq('order', 'a', 2)"
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(last, 2);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         VALUES ('order', 'a', 'Changed', '{{\"n\": 1}}', 1), ('order', 'a', 'Changed', '{{\"n\": 2}}', 2)"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // The Rust producer continues the same sequence.
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 3))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let got: Vec<Option<i64>> = rows(&pool, &schema)
        .await
        .into_iter()
        .map(|r| r.3)
        .collect();
    assert_eq!(got, vec![Some(1), Some(2), Some(3)]);
    // Two rows with the same number for one aggregate are refused.
    let dup = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         VALUES ('order', 'a', 'Changed', '{{}}', 3)"
    )))
    .execute(&pool)
    .await;
    assert!(dup.is_err(), "unique (aggregate, seq)");
    db.cleanup().await;
}

/// The producer's side of an id that comes back: while its first copy is
/// in the outbox, enqueueing it again is a no-op that takes no number;
/// once the relay has deleted it, the id is a new row with the next number
/// (the outbox cannot know it was published). Consumers pass over that
/// number without running the handler
/// (`consumer-lib/tests/ordering/sequence.rs`,
/// `an_id_that_comes_back_with_a_new_number_is_passed_over`).
#[tokio::test]
async fn an_id_enqueued_again_after_delivery_takes_the_next_number() {
    let db = TestDb::producer("ord_again").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let outbox = outbox(&pool, &schema, OrderedAggregates::All).await;
    let again = || event("order", "a", 1).id_from_key("checkout-1");
    for _ in 0..2 {
        let mut tx = pool.begin().await.unwrap();
        outbox.enqueue(&mut *tx, again()).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(
        rows(&pool, &schema).await,
        [("order".into(), "a".into(), 1, Some(1))]
    );
    // The relay delivers and deletes it.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM \"{schema}\".outbox"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut *tx, again()).await.unwrap();
    outbox
        .enqueue(&mut *tx, event("order", "a", 2))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        rows(&pool, &schema).await,
        [
            ("order".into(), "a".into(), 1, Some(2)),
            ("order".into(), "a".into(), 2, Some(3))
        ]
    );
    db.cleanup().await;
}

/// Ordering is the database's, not a handle's: two handles that differ
/// only in their ordering setting (a rolling deploy), and a plain SQL
/// insert (another language), interleaved on one aggregate, all get the
/// aggregate's next number; other types stay unordered.
#[tokio::test]
async fn every_writer_numbers_an_ordered_type_whatever_its_handle_says() {
    let db = TestDb::producer("ord_every").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    // A handle that relies on an ordering the database lacks refuses to
    // start, naming the command.
    let refused = Outbox::new(&pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.ordering = OrderedAggregates::types(["order"]);
        c
    })
    .await
    .unwrap_err();
    assert!(
        matches!(refused, outbox::Error::OrderingNotRegistered { .. }),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("outbox-relay ordering add order")
    );
    let ordered = outbox(&pool, &schema, OrderedAggregates::types(["order"])).await;
    let plain = outbox(&pool, &schema, OrderedAggregates::None).await;
    assert_eq!(
        outbox::ordered_types(&pool, &schema).await.unwrap(),
        ["order"]
    );
    let mut tx = pool.begin().await.unwrap();
    plain
        .enqueue(&mut *tx, event("order", "a", 1))
        .await
        .unwrap();
    ordered
        .enqueue(&mut *tx, event("order", "a", 2))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'a', 'Changed', '{{\"n\": 3}}')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    plain
        .enqueue_many(&mut *tx, [event("order", "a", 4), event("cart", "a", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        rows(&pool, &schema).await,
        [
            ("cart".into(), "a".into(), 1, None),
            ("order".into(), "a".into(), 1, Some(1)),
            ("order".into(), "a".into(), 2, Some(2)),
            ("order".into(), "a".into(), 3, Some(3)),
            ("order".into(), "a".into(), 4, Some(4)),
        ]
    );
    // Stopping ordering stops numbering (and drops the trigger).
    outbox::set_ordered(&pool, &schema, "order", false)
        .await
        .unwrap();
    assert!(
        outbox::ordered_types(&pool, &schema)
            .await
            .unwrap()
            .is_empty()
    );
    let mut tx = pool.begin().await.unwrap();
    plain
        .enqueue(&mut *tx, event("order", "b", 1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let triggers: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = '\"{schema}\".outbox'::regclass
         AND tgname = 'outbox_number_ordered'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(triggers, 0);
    assert!(
        rows(&pool, &schema)
            .await
            .contains(&("order".into(), "b".into(), 1, None))
    );
    db.cleanup().await;
}
