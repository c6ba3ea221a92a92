//! The test harness (`outbox_consumer::testing`): a handler run on built
//! events against the real database, no broker, with the running
//! consumer's dedup, sequencing and outcomes.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use outbox_consumer::testing::{Delivered, EventBuilder, TestConsumer, TestSchema, enqueued};
use outbox_consumer::{
    BatchHandler, BatchOutcome, Conflict, ConsumerConfig, Error, Event, Handler, Outcome,
    Sequencing,
};
use sqlx::PgConnection;

fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A fresh schema with the inbox and an `effects` table.
async fn schema() -> TestSchema {
    let db = TestSchema::create(&database_url()).await.unwrap();
    outbox_consumer::migrate(db.pool(), db.name())
        .await
        .unwrap();
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL, seq bigint, traceparent text)")
        .execute(db.pool())
        .await
        .unwrap();
    db
}

fn config(db: &TestSchema) -> ConsumerConfig {
    let mut config = ConsumerConfig::new("amqp://unused", "q", "c");
    config.schema = db.name().to_owned();
    config
}

/// Writes its effect first (so a failure must roll it back), then
/// answers as the event type says.
#[derive(Default)]
struct Recorder {
    conflicted: Mutex<HashSet<String>>,
}

impl Handler for Recorder {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let written = sqlx::query("INSERT INTO effects VALUES ($1, $2, $3)")
            .bind(event.id())
            .bind(event.aggregate_seq())
            .bind(event.traceparent().as_deref())
            .execute(conn)
            .await;
        if let Err(e) = written {
            return e.into();
        }
        match event.event_type().unwrap_or_default() {
            "retry" => Outcome::retry("busy"),
            "reject" => Outcome::reject("bad"),
            "panic" => panic!("the handler's bug"),
            "conflict" => Outcome::Conflict(Conflict::Deadlock),
            "conflict_once" if self.conflicted.lock().unwrap().insert(event.id().into()) => {
                Outcome::Conflict(Conflict::Serialization)
            }
            _ => Outcome::Ack,
        }
    }
}

async fn effects(db: &TestSchema) -> Vec<(String, Option<i64>)> {
    sqlx::query_as("SELECT event_id, seq FROM effects ORDER BY ctid")
        .fetch_all(db.pool())
        .await
        .unwrap()
}

fn ok(id: &str) -> Event {
    EventBuilder::new("ok").id(id).build()
}

#[tokio::test]
async fn the_same_event_twice_applies_once() {
    let db = schema().await;
    let c = TestConsumer::new(config(&db), db.pool().clone(), Recorder::default()).unwrap();
    let e = ok("e-1");
    assert_eq!(c.deliver(&e).await.unwrap(), Delivered::Applied);
    assert_eq!(c.deliver(&e).await.unwrap(), Delivered::Duplicate);
    // Copies in one batch: the first runs.
    let batch = [ok("e-2"), ok("e-2"), ok("e-1")];
    assert_eq!(
        c.deliver_batch(&batch).await.unwrap(),
        [
            Delivered::Applied,
            Delivered::Duplicate,
            Delivered::Duplicate
        ]
    );
    assert_eq!(
        effects(&db).await,
        [("e-1".into(), None), ("e-2".into(), None)]
    );
    let stats = c.stats();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.batches),
        (2, 3, 3)
    );
    // Another consumer name has an inbox of its own.
    let mut other = config(&db);
    other.consumer_name = "other".into();
    let other = TestConsumer::new(other, db.pool().clone(), Recorder::default()).unwrap();
    assert_eq!(other.deliver(&e).await.unwrap(), Delivered::Applied);
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn sequenced_events_apply_in_order_as_a_running_consumer_applies_them() {
    let db = schema().await;
    let mut cfg = config(&db);
    cfg.sequencing = Sequencing::by_sequence();
    let c = TestConsumer::new(cfg, db.pool().clone(), Recorder::default()).unwrap();
    let at = |kind: &str, seq: i64| {
        EventBuilder::new(kind)
            .aggregate("payment", "p-1")
            .sequence(seq)
            .build()
    };
    // A gap: 2 waits for 1.
    let second = at("ok", 2);
    match c.deliver(&second).await.unwrap() {
        Delivered::Deferred {
            deferral,
            delay,
            reason,
        } => {
            assert_eq!((deferral, delay), (1, Duration::from_secs(1)));
            assert_eq!(reason, "sequence gap: expected 1, got 2");
        }
        other => panic!("not deferred: {other:?}"),
    }
    // Its deferred copy, the 100th: dead-lettered.
    let late = EventBuilder::new("ok")
        .aggregate("payment", "p-1")
        .sequence(2)
        .deferral_count(100)
        .build();
    assert!(matches!(
        c.deliver(&late).await.unwrap(),
        Delivered::DeadLettered { reason } if reason.starts_with("sequence gap never closed after 100 deferrals")
    ));
    // In one batch, out of order: 1 applies, then 2.
    assert_eq!(
        c.deliver_batch(&[second.clone(), at("ok", 1)])
            .await
            .unwrap(),
        [
            Delivered::Deferred {
                deferral: 1,
                delay: Duration::from_secs(1),
                reason: "sequence gap: expected 1, got 2".into()
            },
            Delivered::Applied
        ]
    );
    assert_eq!(c.deliver(&second).await.unwrap(), Delivered::Applied);
    // Another copy of number 1 (another id): stale.
    assert_eq!(
        c.deliver(&at("ok", 1)).await.unwrap(),
        Delivered::Stale { seq: 1, last: 2 }
    );
    // 3 fails: 4 behind it in the batch is held back.
    let held = c
        .deliver_batch(&[at("retry", 3), at("ok", 4)])
        .await
        .unwrap();
    assert!(matches!(&held[0], Delivered::Retried { attempt: 1, reason, .. } if reason == "busy"));
    assert!(
        matches!(&held[1], Delivered::Deferred { reason, .. } if reason.starts_with("held back")),
        "{held:?}"
    );
    let seqs: Vec<_> = effects(&db).await.into_iter().map(|(_, s)| s).collect();
    assert_eq!(seqs, [Some(1), Some(2)]);
    assert_eq!(c.stats().stale, 1);
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn outcomes_are_the_running_consumers() {
    let db = schema().await;
    let mut cfg = config(&db);
    cfg.retry_delay = Duration::from_millis(200);
    let c = TestConsumer::new(cfg, db.pool().clone(), Recorder::default()).unwrap();
    let of = |kind: &str| EventBuilder::new(kind).build();

    assert_eq!(
        c.deliver(&of("retry")).await.unwrap(),
        Delivered::Retried {
            attempt: 1,
            delay: Duration::from_millis(200),
            reason: "busy".into()
        }
    );
    // The third retry's copy: the fourth attempt, backoff doubled thrice.
    let copy = EventBuilder::new("retry").retry_count(3).build();
    assert!(matches!(
        c.deliver(&copy).await.unwrap(),
        Delivered::Retried { attempt: 4, delay, .. } if delay == Duration::from_millis(1600)
    ));
    // Out of retries (max_retries 5).
    let copy = EventBuilder::new("retry").retry_count(5).build();
    assert_eq!(
        c.deliver(&copy).await.unwrap(),
        Delivered::DeadLettered {
            reason: "gave up after 5 retries: busy".into()
        }
    );
    assert_eq!(
        c.deliver(&of("reject")).await.unwrap(),
        Delivered::DeadLettered {
            reason: "bad".into()
        }
    );
    assert!(matches!(
        c.deliver(&of("panic")).await.unwrap(),
        Delivered::Retried { reason, .. } if reason == "handler panicked"
    ));
    assert!(matches!(
        c.deliver(&EventBuilder::new("ok").body("not json").build()).await.unwrap(),
        Delivered::DeadLettered { reason } if reason.starts_with("poison message: body is not valid JSON")
    ));
    // None of the failures left an effect; a retried event is fresh again.
    assert!(effects(&db).await.is_empty());
    let retried = of("retry");
    c.deliver(&retried).await.unwrap();
    assert!(matches!(
        c.deliver(&retried).await.unwrap(),
        Delivered::Retried { .. }
    ));

    // A conflict reruns the batch at once: applied, counted.
    assert_eq!(
        c.deliver(&of("conflict_once")).await.unwrap(),
        Delivered::Applied
    );
    assert_eq!(c.stats().serialization_retries, 1);
    // A failing event does not undo the others of its batch.
    let batch = [ok("a"), of("reject"), ok("b")];
    let delivered = c.deliver_batch(&batch).await.unwrap();
    assert_eq!(delivered[0], Delivered::Applied);
    assert!(matches!(delivered[1], Delivered::DeadLettered { .. }));
    assert_eq!(delivered[2], Delivered::Applied);
    let ids: Vec<_> = effects(&db).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), 3);
    assert!(ids.contains(&"a".to_owned()) && ids.contains(&"b".to_owned()));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_handler_that_always_conflicts_is_retried_through_the_queue() {
    let db = schema().await;
    let mut cfg = config(&db);
    cfg.max_batch_attempts = 1;
    let c = TestConsumer::new(cfg, db.pool().clone(), Recorder::default()).unwrap();
    let delivered = c
        .deliver(&EventBuilder::new("conflict").build())
        .await
        .unwrap();
    assert!(
        matches!(&delivered, Delivered::Retried { attempt: 1, reason, .. } if reason.contains("deadlock detected")),
        "{delivered:?}"
    );
    // The batch, then the event alone: ten reruns each.
    assert_eq!(c.stats().deadlock_retries, 20);
    db.cleanup().await.unwrap();
}

/// Applies the batch's `ok` events, fails the others.
struct Sets;

impl BatchHandler for Sets {
    async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
        let ok: Vec<&str> = events
            .iter()
            .filter(|e| e.event_type() == Some("ok"))
            .map(Event::id)
            .collect();
        if let Err(e) = sqlx::query("INSERT INTO effects (event_id) SELECT unnest($1::text[])")
            .bind(&ok)
            .execute(conn)
            .await
        {
            return BatchOutcome::All(e.into());
        }
        BatchOutcome::Each(
            events
                .iter()
                .map(|e| match e.event_type() {
                    Some("ok") => Outcome::Ack,
                    _ => Outcome::retry("not now"),
                })
                .collect(),
        )
    }
}

#[tokio::test]
async fn batch_handlers_run_once_per_batch_of_fresh_events() {
    let db = schema().await;
    let c = TestConsumer::with_batch_handler(config(&db), db.pool().clone(), Sets).unwrap();
    let later = EventBuilder::new("later").id("l").build();
    let delivered = c
        .deliver_batch(&[ok("x"), ok("x"), later.clone(), ok("y")])
        .await
        .unwrap();
    assert_eq!(delivered[..2], [Delivered::Applied, Delivered::Duplicate]);
    assert!(matches!(&delivered[2], Delivered::Retried { reason, .. } if reason == "not now"));
    assert_eq!(delivered[3], Delivered::Applied);
    assert_eq!(effects(&db).await.len(), 2);
    // The failed one kept no inbox row: it runs again.
    assert!(matches!(
        c.deliver(&later).await.unwrap(),
        Delivered::Retried { .. }
    ));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_producers_events_are_delivered_as_the_relay_would_publish_them() {
    let db = schema().await;
    outbox::migrate(db.pool(), db.name()).await.unwrap();
    let mut config_ob = outbox::OutboxConfig::default();
    config_ob.schema = db.name().to_owned();
    let ob = outbox::Outbox::new(db.pool(), config_ob).await.unwrap();
    let mut tx = db.pool().begin().await.unwrap();
    let event = outbox::NewEvent::new("payment", "p-1", "ok", &serde_json::json!({"cents": 5}))
        .unwrap()
        .header("traceparent", "00-ab-cd-01");
    let id = ob.enqueue(&mut *tx, event).await.unwrap();
    ob.commit(tx).await.unwrap();

    let c = TestConsumer::new(config(&db), db.pool().clone(), Recorder::default()).unwrap();
    let events: Vec<Event> = enqueued(db.pool(), db.name())
        .await
        .unwrap()
        .iter()
        .map(|e| EventBuilder::from(e).build())
        .collect();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].aggregate_id().as_deref(), Some("p-1"));
    assert_eq!(
        events[0].payload::<serde_json::Value>().unwrap(),
        serde_json::json!({"cents": 5})
    );
    assert_eq!(c.deliver(&events[0]).await.unwrap(), Delivered::Applied);
    let traced: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM effects WHERE event_id = $1")
            .bind(id.to_string())
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(traced.as_deref(), Some("00-ab-cd-01"));
    db.cleanup().await.unwrap();
}

#[tokio::test]
async fn an_unmigrated_inbox_and_an_oversized_batch_are_refused() {
    let db = TestSchema::create(&database_url()).await.unwrap();
    let c = TestConsumer::new(config(&db), db.pool().clone(), Recorder::default()).unwrap();
    let err = c.deliver(&ok("e")).await.unwrap_err();
    assert!(err.to_string().contains("not migrated"), "{err}");
    let mut small = config(&db);
    small.batch_size = 1;
    small.prefetch = 1;
    let c = TestConsumer::new(small, db.pool().clone(), Recorder::default()).unwrap();
    assert!(matches!(
        c.deliver_batch(&[ok("a"), ok("b")]).await,
        Err(Error::Config(_))
    ));
    db.cleanup().await.unwrap();
}
