//! Dead letters grouped by failure, against a real database: the error
//! class (migration 12's `outbox_error_class`), the exact groups
//! `admin::failures` counts and the filters that select one group, and the
//! breakdown `outbox-relay status` prints.

use std::process::Command;

use e2e::{TestDb, database_url};
use outbox_relay_ops::admin::{self, Exchange, Failures, Filter, Selection};
use sqlx::AssertSqlSafe;

use e2e::console::*;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

#[tokio::test]
async fn error_classes_replace_ids_quoted_values_hex_and_numbers() {
    let db = TestDb::producer("failures_class").await;
    let cases = [
        (
            "returned by the broker: 312 NO_ROUTE (no queue is bound for this exchange and routing key)",
            "returned by the broker: <n> NO_ROUTE (no queue is bound for this exchange and routing key)",
        ),
        (
            "exchange \"orders-eu-7\" does not exist",
            "exchange \"…\" does not exist",
        ),
        (
            "the broker refused the check of exchange \"billing.v2\": 403 ACCESS_REFUSED - access to exchange 'billing.v2' in vhost '/' refused for user 'relay'",
            "the broker refused the check of exchange \"…\": <n> ACCESS_REFUSED - access to exchange \"…\" in vhost \"…\" refused for user \"…\"",
        ),
        (
            "no publisher confirm within the confirm timeout",
            "no publisher confirm within the confirm timeout",
        ),
        (
            "broker did not answer publish within 5s",
            "broker did not answer publish within <n>s",
        ),
        (
            "the broker closed the channel: 406 PRECONDITION_FAILED - message size 134217729 is larger than configured max size 134217728",
            PRECONDITION_CLASS,
        ),
        (
            "payload is 2000001 bytes, over the relay's limit of 1048576 bytes",
            TOO_LARGE_CLASS,
        ),
        (
            "consumer rejected event 0190f3b2-7c1e-7a3d-9b2e-5f6a7b8c9d0e of order 5F0C3E9A-1B2D-4C3E-8F9A-0B1C2D3E4F50",
            "consumer rejected event <id> of order <id>",
        ),
        (
            "checksum deadbeef12 mismatch at offset 0x1f",
            "checksum <hex> mismatch at offset <hex>",
        ),
        // Apostrophes inside words are not quotes.
        (
            "timeout waiting for the broker's confirm of the relay's batch",
            "timeout waiting for the broker's confirm of the relay's batch",
        ),
    ];
    for (error, class) in cases {
        assert_eq!(
            error_class(&db, error).await,
            class,
            "the class of {error:?}"
        );
    }
    let long = format!("NO_ROUTE: {}", "no queue bound ".repeat(30));
    assert_eq!(error_class(&db, &long).await.chars().count(), 200);
    db.cleanup().await;
}

async fn error_class(db: &TestDb, error: &str) -> String {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT \"{}\".outbox_error_class($1)",
        db.schema
    )))
    .bind(error)
    .fetch_one(&db.pool)
    .await
    .expect("outbox_error_class")
}

/// (key, dead letters) of each group in `top`, in order.
fn counts<K: Clone>(b: &admin::Breakdown<K>) -> Vec<(K, i64)> {
    b.top
        .iter()
        .map(|g| (g.key.clone(), g.dead_letters))
        .collect()
}

fn named(name: &str) -> Exchange {
    Exchange::Named(name.to_owned())
}

#[tokio::test]
async fn dead_letters_group_by_class_event_type_and_exchange_with_exact_counts() {
    let db = TestDb::producer("failures_groups").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    failure_mix(&db).await;
    let f: Failures = admin::failures(&db.pool, &schema, 10).await.unwrap();
    assert_eq!(f.dead_letters, 10);
    let classes = [
        NO_ROUTE_CLASS,
        TOO_LARGE_CLASS,
        REJECTED_CLASS,
        PRECONDITION_CLASS,
    ];
    assert_eq!(
        counts(&f.by_error_class),
        classes
            .iter()
            .map(|c| c.to_string())
            .zip([4, 3, 2, 1])
            .collect::<Vec<_>>()
    );
    assert_eq!(
        counts(&f.by_event_type),
        vec![
            ("OrderPlaced".into(), 6),
            ("OrderPaid".into(), 3),
            ("Refunded".into(), 1)
        ]
    );
    assert_eq!(
        counts(&f.by_exchange),
        vec![
            (Exchange::RelayDefault, 5),
            (named("orders"), 4),
            (named("billing"), 1)
        ]
    );
    assert!(f.by_error_class.others.is_none() && f.by_exchange.others.is_none());
    // Newest: OrderPlaced's newest is its newest of two batches (1 s ago each).
    let newest: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT max(dead_lettered_at) FROM \"{}\".outbox_dead_letters WHERE aggregate_id LIKE 'orderplaced-%'",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(f.by_event_type.top[0].newest, newest);

    // The top two, and the rest together.
    let f = admin::failures(&db.pool, &schema, 2).await.unwrap();
    assert_eq!(counts(&f.by_error_class).len(), 2);
    let others = f.by_error_class.others.as_ref().expect("others");
    assert_eq!((others.groups, others.dead_letters), (2, 3));
    let others = f.by_exchange.others.as_ref().expect("others");
    assert_eq!((others.groups, others.dead_letters), (1, 1));
    assert_eq!(f.by_exchange.dead_letters(), 10);
    db.cleanup().await;
}

#[tokio::test]
async fn each_groups_filter_selects_exactly_its_dead_letters() {
    let db = TestDb::producer("failures_filters").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    failure_mix(&db).await;
    // The phrase filter (the last two) reads the stored words.
    // (how the filter is set, how many it selects)
    type Case = (fn(&mut Filter), i64);
    let cases: [Case; 8] = [
        (|f| f.error_class = Some(NO_ROUTE_CLASS.into()), 4),
        (|f| f.error_class = Some(REJECTED_CLASS.into()), 2),
        (|f| f.error_class = Some("NO_ROUTE".into()), 0),
        (|f| f.exchange = Some(Exchange::RelayDefault), 5),
        (|f| f.exchange = Some(named("orders")), 4),
        (
            |f| {
                f.exchange = Some(Exchange::RelayDefault);
                f.event_type = Some("OrderPlaced".into());
            },
            2,
        ),
        (|f| f.error_words = Some("no_route".into()), 4),
        (|f| f.error_words = Some("max size".into()), 1),
    ];
    for (set, n) in cases {
        let mut filter = Filter::default();
        set(&mut filter);
        let selection = Selection::Matching(filter);
        let found = admin::count_dead_letters(&db.pool, &schema, &selection, None).await;
        assert_eq!(found.unwrap(), n, "{selection:?}");
    }
    db.cleanup().await;
}

fn status(db: &TestDb, json: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.env("DATABASE_URL", database_url())
        .env("OUTBOX_SCHEMA", &db.schema)
        .arg("status");
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("outbox-relay status");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[tokio::test]
async fn status_prints_the_dead_letters_by_class_event_type_and_exchange() {
    let db = TestDb::producer("failures_status").await;
    assert!(
        !status(&db, false).contains("dead letters by"),
        "nothing to group yet"
    );
    failure_mix(&db).await;
    // Three more classes, one dead letter each: seven, of which status names five.
    for error in [
        "nacked by the broker",
        "held back {n}",
        "exchange \"x{n}\" does not exist",
    ] {
        failed_alike(&db, "Shipped", Some("orders"), 1, error).await;
    }
    let text = status(&db, false);
    assert!(
        text.contains(&format!("{:<24}{}", "dead letters", 13)),
        "{text}"
    );
    for line in [
        format!("{:>10} {:>7}  ", 4, "30.8%"),
        "dead letters by error class (most first):".to_owned(),
        format!("  {NO_ROUTE_CLASS}\n"),
        "(2 other error class groups)".to_owned(),
        "dead letters by event type (most first):".to_owned(),
        "  OrderPlaced\n".to_owned(),
        "dead letters by exchange (most first):".to_owned(),
        "  (the relay's default)\n".to_owned(),
    ] {
        assert!(text.contains(&line), "no {line:?} in:\n{text}");
    }
    let s: serde_json::Value = serde_json::from_str(&status(&db, true)).unwrap();
    let f = &s["failures"];
    assert_eq!(f["dead_letters"], 13);
    assert_eq!(f["by_error_class"]["top"].as_array().unwrap().len(), 5);
    assert_eq!(f["by_error_class"]["top"][0]["key"], NO_ROUTE_CLASS);
    assert_eq!(f["by_error_class"]["others"]["groups"], 2);
    // `orders` 4 + 3, the relay's default (null) 5.
    assert_eq!(f["by_exchange"]["top"][0]["key"], "orders");
    assert_eq!(f["by_exchange"]["top"][0]["dead_letters"], 7);
    assert_eq!(f["by_exchange"]["top"][1]["key"], serde_json::Value::Null);
    assert_eq!(f["by_exchange"]["top"][1]["dead_letters"], 5);
    db.cleanup().await;
}
