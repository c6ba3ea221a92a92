//! Rows written through the table contract that cannot go on the wire as
//! they are: the table refuses what a CHECK can state, and the relay
//! dead-letters (with a reason) or publishes intact whatever else it finds,
//! without ever stopping, beside a backlog of good events.

use std::collections::HashMap;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDb, TestRelay, wait_until};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{Value, json};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

const DEADLINE: Duration = Duration::from_secs(120);
const MAX_PAYLOAD: usize = 16 * 1024;

/// One row as another language would insert it.
struct Row {
    name: &'static str,
    aggregate_type: String,
    event_type: String,
    payload: String,
    headers: String,
    exchange: Option<String>,
    routing_key: Option<String>,
}

impl Row {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            aggregate_type: "order".into(),
            event_type: "OrderPlaced".into(),
            payload: "{}".into(),
            headers: "{}".into(),
            exchange: None,
            routing_key: None,
        }
    }
}

async fn insert(db: &TestDb, row: &Row) -> Result<Uuid, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         VALUES ($1, 'bad-1', $2, $3::jsonb, $4::jsonb, $5, $6) RETURNING id",
        db.schema
    )))
    .bind(&row.aggregate_type)
    .bind(&row.event_type)
    .bind(&row.payload)
    .bind(&row.headers)
    .bind(&row.exchange)
    .bind(&row.routing_key)
    .fetch_one(&db.pool)
    .await
}

fn nested(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

/// Rows the table refuses at insert (a CHECK says why), and rows it takes.
fn unpublishable_by_name() -> Vec<Row> {
    let long = "x".repeat(256);
    vec![
        Row {
            exchange: Some(long.clone()),
            ..Row::new("exchange over 255 bytes")
        },
        Row {
            routing_key: Some(long.clone()),
            ..Row::new("routing key over 255 bytes")
        },
        Row {
            event_type: long.clone(),
            ..Row::new("event type over 255 bytes")
        },
        Row {
            aggregate_type: "y".repeat(200),
            event_type: "z".repeat(60),
            ..Row::new("default routing key over 255 bytes")
        },
        Row {
            headers: json!({ long.clone(): 1 }).to_string(),
            ..Row::new("header name over 255 bytes")
        },
    ]
}

/// These tests' relay: [`TestRelay`]'s settings but payloads up to
/// [`MAX_PAYLOAD`], two attempts, a 100 ms poll, retries after 20 ms up to
/// 100 ms and reconnects up to 200 ms.
fn bad_rows_relay(db: &TestDb, broker: &TestBroker) -> TestRelay {
    TestRelay::new(db, broker).with(|c| {
        c.max_payload_bytes = MAX_PAYLOAD;
        c.max_attempts = 2;
        c.poll_interval = Duration::from_millis(100);
        c.retry_base = Duration::from_millis(20);
        c.retry_max = Duration::from_millis(100);
        c.reconnect_min = Duration::from_millis(50);
        c.reconnect_max = Duration::from_millis(200);
    })
}

async fn dead_letters(db: &TestDb) -> HashMap<Uuid, String> {
    let letters: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, last_error FROM \"{}\".outbox_dead_letters",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    letters.into_iter().collect()
}

#[tokio::test]
async fn bad_rows_are_refused_or_dead_lettered_and_never_stop_the_relay() {
    let db = TestDb::producer("bad_rows").await;
    let broker = TestBroker::new("bad_rows", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);

    // The table contract refuses what can never be published.
    for row in unpublishable_by_name() {
        let err = insert(&db, &row)
            .await
            .expect_err(&format!("the table accepted a row with {}", row.name));
        let code = err
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{}: {err}", row.name);
    }

    // Tables from before those CHECKs may hold such rows: the relay must
    // cope with them too.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE \"{s}\".outbox DROP CONSTRAINT IF EXISTS outbox_names_publishable;
         ALTER TABLE \"{s}\".outbox DROP CONSTRAINT IF EXISTS outbox_headers_publishable",
        s = db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();

    let good = db.produce(2_000, 100, Duration::ZERO).await;
    let long = "x".repeat(256);
    // (row, expected reason in the dead letter) for rows that must be
    // dead-lettered.
    let mut dead: Vec<(Row, &str)> = unpublishable_by_name()
        .into_iter()
        .map(|r| {
            let why = match r.name {
                "exchange over 255 bytes" => "exchange",
                "routing key over 255 bytes" | "default routing key over 255 bytes" => {
                    "routing key"
                }
                "event type over 255 bytes" => "event type",
                _ => "header name",
            };
            (r, why)
        })
        .collect();
    dead.push((
        Row {
            payload: json!({ "blob": "p".repeat(MAX_PAYLOAD) }).to_string(),
            ..Row::new("payload over the limit")
        },
        "over the relay's limit",
    ));
    dead.push((
        Row {
            exchange: Some(format!("{}.missing", broker.exchange)),
            ..Row::new("missing exchange")
        },
        "does not exist",
    ));
    dead.push((
        Row {
            headers: json!({ "big": "h".repeat(200 * 1024) }).to_string(),
            ..Row::new("headers over the frame size")
        },
        "headers",
    ));
    let every_type = json!({
        "s": "text", "i": -7, "u": u64::MAX, "f": 1.5, "t": true, "n": null,
        "a": [1, "two", null], "o": { "k": { "deep": [1] } },
        "nested": { long.clone(): "a nested key over 255 bytes" },
        "deeply": serde_json::from_str::<Value>(&nested(100)).unwrap(),
    });
    // Rows the relay must publish intact.
    let intact = vec![
        Row {
            headers: every_type.to_string(),
            ..Row::new("headers of every JSON type")
        },
        Row {
            payload: nested(1_000),
            ..Row::new("deeply nested payload")
        },
        Row {
            headers: format!("{{\"h\": {}}}", nested(500)),
            ..Row::new("deeply nested header value")
        },
    ];
    let mut dead_ids = HashMap::new();
    for (row, why) in &dead {
        let id = insert(&db, row)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        dead_ids.insert(id, (row.name, *why));
    }
    let mut intact_ids = HashMap::new();
    for row in &intact {
        let id = insert(&db, row)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        intact_ids.insert(id, row);
    }

    let relay = bad_rows_relay(&db, &broker).start().await;
    wait_until(DEADLINE, "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    wait_until(
        DEADLINE,
        "every good and intact event on the wire",
        || async { collector.distinct() == good.len() + intact.len() },
    )
    .await;
    assert!(!relay.is_finished(), "the relay stopped");
    assert!(
        !relay.broker_down_now(),
        "the relay reported a broker outage"
    );
    relay.stop().await;

    for id in &good {
        assert!(collector.has(id), "good event {id} missing");
    }
    let letters = dead_letters(&db).await;
    for (id, (name, why)) in &dead_ids {
        let error = letters
            .get(id)
            .unwrap_or_else(|| panic!("{name}: not dead-lettered"));
        assert!(
            error.contains(why),
            "{name}: reason {error:?} lacks {why:?}"
        );
    }
    assert_eq!(
        letters.len(),
        dead_ids.len(),
        "unexpected dead letters: {letters:?}"
    );

    {
        let received = collector.received.lock().unwrap();
        for (id, row) in &intact_ids {
            let d = &received.first[&id.to_string()];
            // These payloads print the same as jsonb text.
            assert_eq!(
                std::str::from_utf8(&d.data).unwrap(),
                row.payload,
                "{}: payload changed",
                row.name
            );
            let h = d.properties.headers().as_ref().unwrap().inner();
            if row.name == "deeply nested header value" {
                assert_eq!(h["h"], AMQPValue::LongString(nested(500).into()));
                continue;
            }
            let sent: serde_json::Map<String, Value> = serde_json::from_str(&row.headers).unwrap();
            for (k, v) in sent {
                let got = &h[k.as_str()];
                let want = match v {
                    Value::Null => AMQPValue::Void,
                    Value::Bool(b) => AMQPValue::Boolean(b),
                    Value::Number(n) => match n.as_i64() {
                        Some(i) => AMQPValue::LongLongInt(i),
                        None if n.is_u64() => AMQPValue::LongString(n.to_string().into()),
                        None => AMQPValue::Double(n.as_f64().unwrap()),
                    },
                    Value::String(s) => AMQPValue::LongString(s.into()),
                    other => AMQPValue::LongString(other.to_string().into()),
                };
                assert_eq!(got, &want, "{}: header {k}", row.name);
            }
        }
    }
    collector.stop();
    broker.cleanup().await;
    db.cleanup().await;
}

/// A worker that panics mid-batch (a relay bug, injected here) reports the
/// batch's events, never claims that batch whole again, sets the culprit
/// aside with the reason, and publishes everything else; the relay never
/// stops.
#[tokio::test]
async fn a_batch_that_panics_is_isolated_and_its_culprit_set_aside() {
    let db = TestDb::producer("panic_batch").await;
    let broker = TestBroker::new("panic_batch", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let mut good = db.produce(150, 50, Duration::ZERO).await;
    let culprit = insert(
        &db,
        &Row {
            event_type: outbox_relay::FAULT_PANIC_EVENT_TYPE.into(),
            ..Row::new("panics the worker")
        },
    )
    .await
    .unwrap();
    good.extend(db.produce(150, 50, Duration::ZERO).await);

    let relay = bad_rows_relay(&db, &broker).start().await;
    // The events set aside unsent go out on the claim's cursor, rewound
    // once they are unlocked, not on its sweep (seen failing with the
    // rewind before the commit and no hold after it: the other worker,
    // finding them locked, moved the cursor past them; 2.5 s now, up to
    // 107 s then with the sweep every 5 s).
    relay.relay().set_claim_sweep(Duration::from_secs(3600));
    wait_until(DEADLINE, "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    wait_until(DEADLINE, "every good event on the wire", || async {
        collector.distinct() == good.len()
    })
    .await;
    assert!(!relay.is_finished(), "the relay stopped");
    // Once with its batch, once alone: the batch is never claimed whole
    // again.
    assert_eq!(relay.worker_panics(), 2);
    relay.stop().await;

    for id in &good {
        assert!(collector.has(id), "good event {id} missing");
    }
    assert!(
        !collector.has(&culprit.to_string()),
        "the culprit was published"
    );
    let letters = dead_letters(&db).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(letters[&culprit].contains("panicked"), "{letters:?}");
    collector.stop();
    broker.cleanup().await;
    db.cleanup().await;
}

/// One worker's channel failing while the connection lives (injected: the
/// worker closes its own channel just before publishing the culprit, in
/// the middle of its batch) ends the session, so both workers start again:
/// the ordered partitions the failed worker served are published too, and
/// the culprit goes through on its retry.
#[tokio::test]
async fn a_channel_failing_under_one_worker_restarts_every_worker() {
    let db = TestDb::producer("chan_fail").await;
    outbox::set_ordered(&db.pool, &db.schema, "order", true)
        .await
        .unwrap();
    let broker = TestBroker::new("chan_fail", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    // Ordered events of 97 aggregates: both workers' partitions have some.
    let mut ids = db.produce(970, 97, Duration::ZERO).await;
    let culprit = insert(
        &db,
        &Row {
            aggregate_type: "account".into(),
            event_type: outbox_relay::FAULT_CHANNEL_EVENT_TYPE.into(),
            ..Row::new("closes its worker's channel")
        },
    )
    .await
    .unwrap();
    ids.push(culprit.to_string());
    let relay = bad_rows_relay(&db, &broker)
        .with(|c| {
            c.workers = 2;
            c.archive = true;
        })
        .start()
        .await;
    wait_until(DEADLINE, "every event on the wire", || async {
        collector.distinct() == ids.len()
    })
    .await;
    // Quiet before judging: events of the failed batch may be on the wire
    // already and still in the outbox, waiting for their retry.
    wait_until(DEADLINE, "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    relay.stop().await;
    // The fault landed: the culprit failed once (its channel closed under
    // the batch), then was delivered.
    let attempts: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT attempts FROM \"{}\".outbox_archive WHERE id = $1",
        db.schema
    )))
    .bind(culprit)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2, "one failed attempt, then the delivery");
    assert_eq!(db.count("outbox").await, 0);
    collector.stop();
    broker.cleanup().await;
    db.cleanup().await;
}

/// An ordered row from before migration 4 that the CHECKs would refuse
/// (they were added NOT VALID, so it stays) is never dead-lettered by the
/// relay: its failure is recorded with an UPDATE, which the CHECKs let
/// through for a row already tried. It blocks its own aggregate with the
/// reason; everything else is published once.
#[tokio::test]
async fn an_old_unpublishable_ordered_row_blocks_only_its_aggregate() {
    let db = TestDb::producer("bad_ordered").await;
    let broker = TestBroker::new("bad_ordered", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let s = &db.schema;
    let constraints = sqlx::SqlSafeStr::into_sql_str(AssertSqlSafe(format!(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = '\"{s}\".outbox'::regclass AND conname = 'outbox_names_publishable'"
    )));
    let def: String = sqlx::query_scalar(constraints.clone())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // The old row, then the CHECK as migration 4 leaves it: NOT VALID.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE \"{s}\".outbox DROP CONSTRAINT outbox_names_publishable;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, routing_key, aggregate_seq)
         VALUES ('account', 'a-1', 'Opened', '{{}}', repeat('r', 300), 1);
         ALTER TABLE \"{s}\".outbox ADD CONSTRAINT outbox_names_publishable {def}"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let good = db.produce(200, 50, Duration::ZERO).await;
    let relay = bad_rows_relay(&db, &broker).start().await;
    wait_until(DEADLINE, "the good events", || async {
        collector.distinct() == good.len()
    })
    .await;
    let schema = outbox::Ident::new("schema", s).unwrap();
    wait_until(DEADLINE, "the old row blocking its aggregate", || async {
        let blocked = outbox_relay_ops::admin::blocked_aggregates(&db.pool, &schema, 10)
            .await
            .unwrap();
        blocked.len() == 1
            && blocked[0]
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("routing key"))
    })
    .await;
    assert!(!relay.is_finished(), "the relay stopped");
    relay.stop().await;
    assert_eq!(db.count("outbox").await, 1, "only the old row is left");
    assert_eq!(db.count("outbox_dead_letters").await, 0);
    assert_eq!(
        collector.received.lock().unwrap().duplicates(),
        0,
        "a batch was published again"
    );
    collector.stop();
    broker.cleanup().await;
    db.cleanup().await;
}

/// The SQL producer of the write-ahead-log capture (`outbox_emit`) refuses
/// every event the outbox table refuses, with the same reason, and takes
/// what the table takes: both go through one definition of publishable
/// (migration 11), so the log never carries an event that the reader
/// could not publish and the table would not take back.
#[tokio::test]
async fn wal_emit_refuses_what_the_table_refuses() {
    let db = TestDb::producer_wal("bad_emit").await;
    let emit = |row: &Row| {
        sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(format!(
            "SELECT \"{}\".outbox_emit($1, 'bad-1', $2, $3::jsonb, $4::jsonb, $5, $6)",
            db.schema
        )))
        .bind(row.aggregate_type.clone())
        .bind(row.event_type.clone())
        .bind(row.payload.clone())
        .bind(row.headers.clone())
        .bind(row.exchange.clone())
        .bind(row.routing_key.clone())
        .fetch_one(&db.pool)
    };
    for row in unpublishable_by_name() {
        let table = insert(&db, &row).await.unwrap_err();
        let log = emit(&row)
            .await
            .expect_err(&format!("outbox_emit took an event with {}", row.name));
        for err in [&table, &log] {
            let code = err
                .as_database_error()
                .and_then(|e| e.code())
                .map(|c| c.into_owned());
            assert_eq!(code.as_deref(), Some("23514"), "{}: {err}", row.name);
        }
        let field = match row.name {
            "exchange over 255 bytes" => "exchange is 256 bytes",
            "routing key over 255 bytes" => "routing_key is 256 bytes",
            "event type over 255 bytes" => "event_type is 256 bytes",
            "default routing key over 255 bytes" => "default routing key",
            _ => "a header name is over 255 bytes",
        };
        assert!(log.to_string().contains(field), "{}: {log}", row.name);
    }
    // At the limit, both take it.
    let at_limit = "x".repeat(255);
    let fits = [
        Row {
            exchange: Some(at_limit.clone()),
            ..Row::new("exchange of 255 bytes")
        },
        Row {
            event_type: at_limit.clone(),
            routing_key: Some("k".into()),
            ..Row::new("event type of 255 bytes")
        },
        Row {
            headers: json!({ at_limit.clone(): 1 }).to_string(),
            ..Row::new("header name of 255 bytes")
        },
    ];
    for row in &fits {
        insert(&db, row).await.unwrap();
        emit(row).await.unwrap();
    }
    db.cleanup().await;
}

/// The CHECKs' inline shortcut (migration 14: names within 255 bytes,
/// headers' JSON text within 255 bytes) takes only rows that the one
/// definition, `outbox_unpublishable`, takes; and the table refuses
/// exactly what the function refuses. Rows around every limit, in bytes of
/// one and of two-byte characters, and headers whose text the escapes of
/// their keys make longer than the keys.
#[tokio::test]
async fn the_checks_shortcut_takes_only_what_the_function_takes() {
    let db = TestDb::producer("bad_shortcut").await;
    let mut rows = Vec::new();
    for n in [127usize, 128, 253, 254, 255, 256, 257] {
        for text in ["x".repeat(n), "é".repeat(n / 2)] {
            rows.push(Row {
                event_type: text.clone(),
                routing_key: Some("k".into()),
                ..Row::new("event type")
            });
            rows.push(Row {
                exchange: Some(text.clone()),
                ..Row::new("exchange")
            });
            rows.push(Row {
                routing_key: Some(text.clone()),
                ..Row::new("routing key")
            });
            rows.push(Row {
                aggregate_type: text.clone(),
                event_type: "E".into(),
                ..Row::new("default routing key")
            });
            for (key, value) in [
                (text.clone(), json!(1)),
                (format!("{}\"", &text[..text.len().min(250)]), json!(1)),
                (format!("a\u{1}{}", "b".repeat(n.min(250))), json!("v")),
                ("k".into(), json!(text.clone())),
            ] {
                rows.push(Row {
                    headers: json!({ key: value, "traceparent": "00-1-2-01" }).to_string(),
                    ..Row::new("headers")
                });
            }
        }
    }
    let (mut taken, mut refused) = (0, 0);
    for row in &rows {
        let publishable: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT \"{}\".outbox_unpublishable($1, $2, $3, $4, $5::jsonb) IS NULL",
            db.schema
        )))
        .bind(&row.aggregate_type)
        .bind(&row.event_type)
        .bind(&row.exchange)
        .bind(&row.routing_key)
        .bind(&row.headers)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let inserted = insert(&db, row).await;
        assert_eq!(
            inserted.is_ok(),
            publishable,
            "{} ({} bytes of event type, {} of headers): the table and the function disagree: {inserted:?}",
            row.name,
            row.event_type.len(),
            row.headers.len()
        );
        if publishable {
            taken += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        taken > 20 && refused > 20,
        "{taken} taken, {refused} refused"
    );
    db.cleanup().await;
}
