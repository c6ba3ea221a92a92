//! Any message written on the outbox's prefix of the write-ahead log is
//! accounted for (published, recorded in the table or dead-lettered) and
//! the slot moves past it: a property test of arbitrary contents between
//! good events (`WAL_ANYMSG_SEED` replays a failure).

use std::time::Duration;

use e2e::wal::{confirmed_past, emit_sql, position};
use e2e::{Collector, TestBroker, TestDb, TestRelay, wait_until};
use lapin::types::FieldTable;
use sqlx::AssertSqlSafe;

const DEADLINE: Duration = Duration::from_secs(60);

/// One message a test writes on the schema's prefix: an event as any
/// producer might write it (names up to 300 bytes, any JSON, NUL in text,
/// unknown format versions, a missing exchange), JSON that is no event,
/// or text that is no JSON.
#[derive(Debug, Clone)]
enum Written {
    Event {
        id: uuid::Uuid,
        content: String,
        transactional: bool,
    },
    /// JSON that is no event of the contract; `id` when it names one.
    Json {
        id: Option<uuid::Uuid>,
        content: String,
    },
    Text(String),
}

impl Written {
    fn id(&self) -> Option<uuid::Uuid> {
        match self {
            Written::Event { id, .. } => Some(*id),
            Written::Json { id, .. } => *id,
            Written::Text(_) => None,
        }
    }

    fn content(&self) -> &str {
        match self {
            Written::Event { content, .. } | Written::Json { content, .. } => content,
            Written::Text(t) => t,
        }
    }

    fn transactional(&self) -> bool {
        !matches!(
            self,
            Written::Event {
                transactional: false,
                ..
            }
        )
    }
}

mod arbitrary {
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    use super::Written;

    /// Names of 0 to 300 bytes: plain, long, multi-byte, with NUL.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            20 => "[a-zA-Z0-9._-]{1,24}",
            2 => "[a-z]{250,300}",
            1 => "[é]{120,150}",
            1 => "[a-z]{1,4}\u{0}[a-z]{1,4}",
            1 => Just(String::new()),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            ".{0,16}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..4).prop_map(Value::Array),
                btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn event() -> impl Strategy<Value = Written> {
        (
            any::<u128>(),
            prop_oneof![8 => Just(1u32), 1 => Just(2u32), 1 => Just(0u32)],
            (name(), name(), name()),
            json_value(),
            btree_map(name(), json_value(), 0..3),
            prop_oneof![
                6 => Just(None),
                2 => "[a-z]{1,12}".prop_map(|x| Some(format!("missing.{x}"))),
                1 => "[a-z]{256,300}".prop_map(Some),
            ],
            proptest::option::of(name()),
            prop_oneof![9 => Just(true), 1 => Just(false)],
        )
            .prop_map(
                |(
                    id,
                    v,
                    (aggregate_type, aggregate_id, event_type),
                    payload,
                    headers,
                    exchange,
                    routing_key,
                    transactional,
                )| {
                    let id = uuid::Uuid::from_u128(id);
                    let content = json!({
                        "v": v,
                        "id": id,
                        "aggregate_type": aggregate_type,
                        "aggregate_id": aggregate_id,
                        "event_type": event_type,
                        "payload": payload,
                        "headers": Value::Object(headers.into_iter().collect::<Map<_, _>>()),
                        "exchange": exchange,
                        "routing_key": routing_key,
                        "aggregate_seq": null,
                        "created_at": "2026-12-02T04:00:00.123456+00:00",
                    });
                    Written::Event {
                        id,
                        content: content.to_string(),
                        transactional,
                    }
                },
            )
    }

    fn not_an_event() -> impl Strategy<Value = Written> {
        prop_oneof![
            (json_value(), proptest::option::of(any::<u128>())).prop_map(|(v, id)| {
                let id = id.map(uuid::Uuid::from_u128);
                let mut object = match v {
                    Value::Object(m) => m,
                    other => Map::from_iter([("value".to_owned(), other)]),
                };
                object.remove("id");
                if let Some(id) = id {
                    object.insert("id".to_owned(), json!(id));
                }
                Written::Json {
                    id,
                    content: Value::Object(object).to_string(),
                }
            }),
            ".{0,40}"
                .prop_filter("not JSON", |t| serde_json::from_str::<Value>(t).is_err())
                .prop_map(Written::Text),
        ]
    }

    pub(super) fn message() -> impl Strategy<Value = Written> {
        prop_oneof![3 => event(), 1 => not_an_event()]
    }
}

/// Whatever is written on the outbox prefix, by whatever writer, the
/// reader accounts for it (published, queued in the table, or
/// dead-lettered with its reason), the slot moves past it, and the good
/// events around it are published once each: one bad message never holds
/// the stream or makes copies of its neighbours.
#[tokio::test]
async fn wal_any_message_on_the_outbox_prefix_is_accounted_for() {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let db = TestDb::producer_wal("wal_anymsg").await;
    let broker = TestBroker::new("wal_anymsg", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let seed: [u8; 32] = rand_seed();
    println!(
        "seed {}",
        seed.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    );
    let strategy = arbitrary::message();
    let written: Vec<Written> = (0..160)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect();
    let cfg = TestRelay::new(&db, &broker)
        .wal()
        .with(|c| c.max_attempts = 2);
    let relay = cfg
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    let prefix = format!("outbox:{}", db.schema);
    let mut neighbours = Vec::new();
    for (n, w) in written.iter().enumerate() {
        // Each bad message between good ones, in one transaction.
        let mut tx = db.pool.begin().await.unwrap();
        let around = |at: String| emit_sql(&db.schema).bind(at);
        neighbours.push(
            around(format!("before-{n}"))
                .fetch_one(&mut *tx)
                .await
                .unwrap(),
        );
        // As bytes: a writer may put anything there, NUL included.
        sqlx::query("SELECT pg_logical_emit_message($1, $2, $3::bytea)")
            .bind(w.transactional())
            .bind(&prefix)
            .bind(w.content().as_bytes())
            .execute(&mut *tx)
            .await
            .unwrap();
        neighbours.push(
            around(format!("after-{n}"))
                .fetch_one(&mut *tx)
                .await
                .unwrap(),
        );
        tx.commit().await.unwrap();
    }
    let end = position(&db).await;

    wait_until(
        DEADLINE,
        "the slot confirmed past every message",
        || async { confirmed_past(&db, &end).await },
    )
    .await;
    wait_until(DEADLINE, "the table's retries settled", || async {
        db.count("outbox").await == 0
    })
    .await;
    wait_until(DEADLINE, "every neighbour", || async {
        neighbours.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;

    let dead: Vec<(uuid::Uuid, String, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregate_type, last_error FROM \"{}\".outbox_dead_letters",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let dead_ids: std::collections::HashSet<uuid::Uuid> = dead.iter().map(|d| d.0).collect();
    let refused_by_table = dead
        .iter()
        .filter(|d| d.2.contains("the outbox table refused"))
        .count();
    let as_text = dead
        .iter()
        .filter(|d| d.2.contains("the dead letters refused its fields too"))
        .count();
    println!(
        "{} messages: {} published, {} dead letters ({} refused by the table, {} kept as text)",
        written.len(),
        collector.distinct() - neighbours.len(),
        dead.len(),
        refused_by_table,
        as_text
    );
    assert!(
        dead.iter().all(|d| !d.2.is_empty()),
        "every dead letter says why"
    );
    let mut unaccounted = Vec::new();
    for w in &written {
        if let Some(id) = w.id() {
            let published = collector.has(&id.to_string());
            let dead = dead_ids.contains(&id);
            if published == dead {
                unaccounted.push(format!(
                    "published {published}, dead-lettered {dead}: {w:?}"
                ));
            }
        }
    }
    assert!(unaccounted.is_empty(), "{unaccounted:#?}");
    let known: std::collections::HashSet<uuid::Uuid> =
        written.iter().filter_map(Written::id).collect();
    let anonymous = written.iter().filter(|w| w.id().is_none()).count();
    let anonymous_dead = dead
        .iter()
        .filter(|d| d.1 == "(unreadable)" && !known.contains(&d.0))
        .count();
    assert_eq!(
        anonymous_dead, anonymous,
        "messages without an id, dead-lettered"
    );
    assert!(
        neighbours.iter().all(|i| !dead_ids.contains(i)),
        "a good event was dead-lettered"
    );
    assert_eq!(collector.duplicates(), 0, "nothing was published twice");
    broker.cleanup().await;
}

/// A fresh seed, or the one `WAL_ANYMSG_SEED` names (64 hex digits, as
/// the test prints it), to replay a failure.
fn rand_seed() -> [u8; 32] {
    let mut seed = [0u8; 32];
    if let Ok(hex) = std::env::var("WAL_ANYMSG_SEED") {
        assert_eq!(hex.len(), 64, "WAL_ANYMSG_SEED: 64 hex digits");
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("WAL_ANYMSG_SEED: hex");
        }
        return seed;
    }
    seed[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    seed[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    seed
}
