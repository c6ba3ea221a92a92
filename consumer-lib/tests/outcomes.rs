//! Retry, reject and poison: every outcome ends acked and accounted for,
//! and the consumer keeps running.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use e2e::consumer::{Env, Running, id, wait_until};
use lapin::types::AMQPValue;
use outbox_consumer::{Consumer, DedupKey, Event, Handler, Outcome};
use sqlx::{AssertSqlSafe, PgConnection};

/// Fails with `Retry` the first `failures` times it sees an event, then
/// records the effect. Remembers each attempt's retry count and time.
struct Flaky {
    failures: u32,
    reject: bool,
    sql: String,
    attempts: Mutex<HashMap<String, Vec<(u32, Instant)>>>,
}

impl Flaky {
    fn new(schema: &str, failures: u32) -> Self {
        Self {
            failures,
            reject: false,
            sql: format!("INSERT INTO {schema}.effects (event_id) VALUES ($1)"),
            attempts: Mutex::default(),
        }
    }

    fn attempts(&self, id: &str) -> Vec<(u32, Instant)> {
        self.attempts
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .unwrap_or_default()
    }
}

impl Handler for Flaky {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        // The effect is written first, so a failure must roll it back.
        if let Err(e) = sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            return Outcome::retry(e);
        }
        let n = {
            let mut a = self.attempts.lock().unwrap();
            let v = a.entry(event.id().to_owned()).or_default();
            v.push((event.retry_count(), Instant::now()));
            v.len() as u32
        };
        if self.reject {
            Outcome::reject("out of stock")
        } else if n <= self.failures {
            Outcome::retry("warehouse service unavailable")
        } else {
            Outcome::Ack
        }
    }
}

fn header(m: &lapin::message::BasicGetMessage, name: &str) -> Option<AMQPValue> {
    m.properties.headers().as_ref()?.inner().get(name).cloned()
}

fn text(v: Option<AMQPValue>) -> String {
    match v {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("not a string header: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failure_twice_then_success_gives_one_effect_via_the_retry_queue() {
    let env = Env::new().await;
    let mut cfg = env.config("svc");
    cfg.retry_delay = Duration::from_millis(200);
    let handler = std::sync::Arc::new(Flaky::new(&env.schema, 2));
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Shared(handler.clone())).unwrap());
    let event = id();
    env.publish(Some(&event), "{}").await;
    wait_until("processed after two retries", || async {
        c.consumer.stats().processed == 1
    })
    .await;
    let attempts = handler.attempts(&event);
    // The retry count travels in the header: the copies came back through
    // `<queue>.retry`, after the backoff (200 ms, then 400 ms), not a hot loop.
    assert_eq!(
        attempts.iter().map(|a| a.0).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(attempts[1].1 - attempts[0].1 >= Duration::from_millis(190));
    assert!(attempts[2].1 - attempts[1].1 >= Duration::from_millis(390));
    assert_eq!(c.consumer.stats().retried, 2);
    assert_eq!(
        env.count("{s}.effects").await,
        1,
        "the failed attempts were rolled back"
    );
    assert_eq!(env.count("{s}.inbox_processed").await, 1);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_retries_lands_in_the_dlq() {
    let env = Env::new().await;
    let mut cfg = env.config("svc");
    cfg.retry_delay = Duration::from_millis(20);
    cfg.max_retries = 2;
    let handler = std::sync::Arc::new(Flaky::new(&env.schema, u32::MAX));
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Shared(handler.clone())).unwrap());
    let event = id();
    env.publish(Some(&event), "{}").await;
    let dlq = env.take(&format!("{}.dlq", env.queue), 1).await;
    assert_eq!(
        dlq[0].properties.message_id().as_ref().unwrap().as_str(),
        event
    );
    let reason = text(header(&dlq[0], "x-dead-letter-reason"));
    assert!(
        reason.contains("gave up after 2 retries: warehouse service unavailable"),
        "{reason}"
    );
    assert_eq!(
        handler.attempts(&event).len(),
        3,
        "the first try and two retries"
    );
    assert_eq!(env.count("{s}.effects").await, 0);
    assert_eq!(
        env.count("{s}.inbox_processed").await,
        0,
        "a dead-lettered event can be replayed"
    );
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_lands_in_the_dlq_with_its_reason() {
    let env = Env::new().await;
    let mut handler = Flaky::new(&env.schema, 0);
    handler.reject = true;
    let c = Running::start(Consumer::new(env.config("svc"), env.pool.clone(), handler).unwrap());
    let event = id();
    env.publish(Some(&event), r#"{"sku":"A"}"#).await;
    let dlq = env.take(&format!("{}.dlq", env.queue), 1).await;
    let m = &dlq[0];
    assert_eq!(m.properties.message_id().as_ref().unwrap().as_str(), event);
    assert_eq!(text(header(m, "x-dead-letter-reason")), "out of stock");
    assert_eq!(
        text(header(m, "x-aggregate-id")),
        "o-1",
        "the contract headers are kept"
    );
    assert_eq!(m.data, br#"{"sku":"A"}"#);
    wait_until("the original acked", || async {
        c.consumer.stats().rejected == 1
    })
    .await;
    assert_eq!(env.count("{s}.effects").await, 0);
    assert_eq!(env.count("{s}.inbox_processed").await, 0);
    c.stop().await;
    env.teardown().await;
}

/// A failing event in a batch does not undo the others (savepoints).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_event_does_not_undo_its_batch() {
    struct RejectOdd(String);
    impl Handler for RejectOdd {
        async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
            let n: i64 = event.payload::<serde_json::Value>().unwrap()["n"]
                .as_i64()
                .unwrap();
            if let Err(e) = sqlx::query(AssertSqlSafe(self.0.clone()))
                .bind(event.id())
                .execute(conn)
                .await
            {
                return Outcome::retry(e);
            }
            if n % 2 == 1 {
                Outcome::reject("odd")
            } else {
                Outcome::Ack
            }
        }
    }
    let env = Env::new().await;
    let msgs: Vec<_> = (0..100)
        .map(|n| (Some(id()), format!(r#"{{"n":{n}}}"#).into_bytes()))
        .collect();
    env.publish_all(&msgs).await;
    let sql = format!("INSERT INTO {}.effects (event_id) VALUES ($1)", env.schema);
    let c =
        Running::start(Consumer::new(env.config("svc"), env.pool.clone(), RejectOdd(sql)).unwrap());
    wait_until("all settled", || async {
        c.consumer.stats().acked() == 100
    })
    .await;
    assert_eq!(c.consumer.stats().processed, 50);
    assert_eq!(c.consumer.stats().rejected, 50);
    assert_eq!(env.count("{s}.effects").await, 50);
    assert_eq!(env.count("{s}.inbox_processed").await, 50);
    assert_eq!(env.take(&format!("{}.dlq", env.queue), 50).await.len(), 50);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_land_in_the_dlq_and_the_consumer_keeps_going() {
    let env = Env::new().await;
    let c = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Flaky::new(&env.schema, 0),
        )
        .unwrap(),
    );
    env.publish(None, r#"{"sku":"A"}"#).await; // no message id
    env.publish(Some(&id()), "not json {").await; // undecodable body
    let good = id();
    env.publish(Some(&good), "{}").await;
    wait_until("the good message processed", || async {
        c.consumer.stats().processed == 1
    })
    .await;
    assert_eq!(c.consumer.stats().poison, 2);
    let dlq = env.take(&format!("{}.dlq", env.queue), 2).await;
    let mut reasons: Vec<String> = dlq
        .iter()
        .map(|m| text(header(m, "x-dead-letter-reason")))
        .collect();
    reasons.sort();
    assert!(reasons[0].contains("body is not valid JSON"), "{reasons:?}");
    assert!(reasons[1].contains("no message_id"), "{reasons:?}");
    assert_eq!(
        dlq.iter()
            .find(|m| m.data == b"not json {")
            .map(|m| m.data.len()),
        Some(10),
        "body kept"
    );
    assert_eq!(env.count("{s}.effects").await, 1);
    c.stop().await;
    env.teardown().await;
}

/// Messages from foreign producers: dedup by a natural key in the payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_field_dedup_key() {
    let env = Env::new().await;
    let mut cfg = env.config("svc");
    cfg.dedup_key = DedupKey::PayloadField("/order_id".into());
    let c =
        Running::start(Consumer::new(cfg, env.pool.clone(), Flaky::new(&env.schema, 0)).unwrap());
    // Different message ids, same natural key: one effect.
    env.publish(Some(&id()), r#"{"order_id": 42}"#).await;
    env.publish(Some(&id()), r#"{"order_id": 42}"#).await;
    env.publish(None, r#"{"other": 1}"#).await; // no key: poison
    wait_until("all settled", || async { c.consumer.stats().acked() == 3 }).await;
    let s = c.consumer.stats();
    assert_eq!((s.processed, s.duplicates, s.poison), (1, 1, 1));
    assert_eq!(
        env.count("{s}.inbox_processed WHERE event_id = '42'").await,
        1
    );
    let dlq = env.take(&format!("{}.dlq", env.queue), 1).await;
    assert!(text(header(&dlq[0], "x-dead-letter-reason")).contains("/order_id"));
    c.stop().await;
    env.teardown().await;
}

/// Lets a test keep a handle on the handler it gave the consumer.
struct Shared<H>(std::sync::Arc<H>);

impl<H: Handler> Handler for Shared<H> {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        self.0.handle(conn, event).await
    }
}
