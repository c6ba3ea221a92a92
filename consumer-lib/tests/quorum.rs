//! Quorum queues: the retry path cannot lose a retry, a message that keeps
//! coming back ends in the dead-letter queue, and a queue declared
//! otherwise before gives one clear error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::consumer::{DEADLINE, Env, Running, wait_until};
use lapin::options::{BasicGetOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use outbox_consumer::{
    Consumer, Error, Event, Handler, Outcome, QueueType, TopologyConfig, declare_topology,
};
use sqlx::{AssertSqlSafe, PgConnection};

/// Asks for one retry of every event whose id starts with `r-`, then
/// applies it; applies every other event at once. Records each delivery's
/// `x-delivery-count`.
#[derive(Clone)]
struct RetryOnce {
    sql: String,
    delivery_counts: Arc<Mutex<HashMap<String, u32>>>,
}

impl Handler for RetryOnce {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        self.delivery_counts
            .lock()
            .unwrap()
            .insert(event.id().to_owned(), event.delivery_count());
        if event.id().starts_with("r-") && event.retry_count() == 0 {
            return Outcome::retry("first attempt of a retried event");
        }
        match sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}

/// Gives a delivery back unacked (what a crashing consumer does).
async fn requeue(m: lapin::message::BasicGetMessage) {
    m.delivery
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// Messages ready in `queue` (u32::MAX while it cannot be read).
async fn depth(env: &Env, queue: &str) -> u32 {
    e2e::depth(&env.amqp, queue).await.0
}

/// Retries wait in the retry queue for their delay, then go back to the
/// work queue. Here the work queue is full when they expire (max-length
/// with reject-publish, the consumer stopped). Classic: the broker drops
/// them. Quorum: none is lost; RabbitMQ 3.10's quorum work queue takes the
/// dead-lettered retries past its bound (its limit is soft), so this run
/// does not isolate the retry queue's at-least-once strategy: the
/// missing-work-queue tests below do.
/// Waits until `expected` effects are applied, then until everything is
/// quiet; returns (applied, distinct).
async fn retries_expiring_into_a_full_work_queue(
    queue_type: QueueType,
    expected: i64,
) -> (i64, i64) {
    let r = RetryPath::new("full", queue_type, Some(20)).await;
    let expired_by = r.retry_ten().await;
    assert_eq!(depth(&r.env, &r.queue).await, 0);
    // Fill the work queue to its bound before any retry expires.
    let fillers: Vec<String> = (0..20)
        .map(|i| format!("f-{i}-{}", e2e::consumer::id()))
        .collect();
    publish(&r.env, &fillers, "full.filler").await;
    assert!(
        tokio::time::Instant::now() < expired_by,
        "the work queue was filled too late to be full when the retries expired"
    );
    assert_eq!(depth(&r.env, &r.queue).await, 20, "the work queue is full");
    // Every retry has expired (their per-message TTL is a clock) while the
    // work queue stayed full: nothing consumed it meanwhile.
    tokio::time::sleep_until(expired_by + Duration::from_millis(500)).await;
    // Classic: the expired retries were dropped (20 left). Quorum: RabbitMQ
    // 3.10 lets confirmed dead letters into a queue at its bound (30).
    let after = depth(&r.env, &r.queue).await + depth(&r.env, &r.retry_queue()).await;
    assert!(after >= 20, "the fillers are still there: {after}");
    r.consume_until_quiet(expected).await
}

/// One retry-path scenario: a topology of its own, a consumer that asks
/// for one retry (2 s) of every `r-` event.
struct RetryPath {
    env: Env,
    queue: String,
    key: String,
    topology: TopologyConfig,
    config: outbox_consumer::ConsumerConfig,
    handler: RetryOnce,
}

impl RetryPath {
    async fn new(name: &str, queue_type: QueueType, max_length: Option<u32>) -> Self {
        let mut env = Env::new().await;
        let queue = format!("{}_{name}", env.queue);
        let mut topology = TopologyConfig::new(&queue, &env.exchange, format!("{name}.#"));
        topology.queue_type = queue_type;
        topology.max_length = max_length;
        declare_topology(&env.amqp, &topology).await.unwrap();
        env.delete_on_teardown(&queue);
        let handler = RetryOnce {
            sql: format!("INSERT INTO {}.effects (event_id) VALUES ($1)", env.schema),
            delivery_counts: Arc::default(),
        };
        let mut config = env.config("svc");
        config.queue = queue.clone();
        config.queue_type = queue_type;
        config.retry_delay = Duration::from_secs(2);
        Self {
            env,
            queue,
            key: name.to_owned(),
            topology,
            config,
            handler,
        }
    }

    fn retry_queue(&self) -> String {
        format!("{}.retry", self.queue)
    }

    fn consumer(&self) -> Running {
        Running::start(
            Consumer::new(
                self.config.clone(),
                self.env.pool.clone(),
                self.handler.clone(),
            )
            .unwrap(),
        )
    }

    /// Ten events, each sent to the retry queue once; the consumer is
    /// stopped. Returns when the last retry expires at the latest.
    async fn retry_ten(&self) -> tokio::time::Instant {
        let running = self.consumer();
        let ids: Vec<String> = (0..10)
            .map(|i| format!("r-{i}-{}", e2e::consumer::id()))
            .collect();
        publish(&self.env, &ids, &format!("{}.retried", self.key)).await;
        wait_until("every event sent to the retry queue", || async {
            running.consumer.stats().retried == 10
        })
        .await;
        let expired_by = tokio::time::Instant::now() + self.config.retry_delay;
        running.stop().await;
        expired_by
    }

    /// Consumes until `expected` effects are applied and everything is
    /// quiet (both queues empty, counting retries waiting to be
    /// dead-lettered, with the consumer stopped: nothing unacked anywhere);
    /// returns (applied, distinct).
    async fn consume_until_quiet(self, expected: i64) -> (i64, i64) {
        let (env, queue, retry_queue) = (&self.env, &self.queue, self.retry_queue());
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let running = self.consumer();
            wait_until(
                "every expected effect applied, both queues empty",
                || async {
                    depth(env, queue).await == 0
                        && all_messages(&retry_queue) == 0
                        && env.count("{s}.effects").await >= expected
                },
            )
            .await;
            running.stop().await;
            if depth(env, queue).await == 0 && all_messages(&retry_queue) == 0 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "never quiet");
        }
        let applied = env.count("{s}.effects").await;
        let distinct = env
            .count("(SELECT DISTINCT event_id FROM {s}.effects) d")
            .await;
        self.env.teardown().await;
        (applied, distinct)
    }
}

async fn publish(env: &Env, ids: &[String], routing_key: &str) {
    let confirms = {
        let mut v = Vec::new();
        for id in ids {
            let props = lapin::BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            v.push(
                env.channel
                    .basic_publish(
                        env.exchange.as_str().into(),
                        routing_key.into(),
                        lapin::options::BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        b"{}",
                        props,
                    )
                    .await
                    .unwrap(),
            );
        }
        v
    };
    for c in confirms {
        assert_eq!(c.await.unwrap(), lapin::Confirmation::Ack(None));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_retries_wait_out_a_full_work_queue() {
    let (applied, distinct) = retries_expiring_into_a_full_work_queue(QueueType::Quorum, 30).await;
    assert_eq!(
        distinct, 30,
        "every event applied: 20 fillers and 10 retried"
    );
    assert_eq!(applied, 30, "none applied twice");
}

/// Why quorum is the default: the same run on classic queues loses the
/// retries that expired while the work queue was full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_retries_expiring_into_a_full_work_queue_are_lost() {
    let (applied, distinct) = retries_expiring_into_a_full_work_queue(QueueType::Classic, 20).await;
    assert_eq!(applied, distinct, "none applied twice");
    assert_eq!(distinct, 20, "the broker dropped the 10 expired retries");
}

/// Every message of `queue` on the default broker, ready or not: a quorum
/// queue's messages waiting to be dead-lettered at-least-once are not
/// counted by an AMQP passive declare, `rabbitmqctl` counts them.
/// A failed `rabbitmqctl` (it times out on a loaded machine) is asked
/// again until a deadline, then reported with what it printed.
fn all_messages(queue: &str) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let rows: Vec<serde_json::Value> = loop {
        let out = std::process::Command::new("rabbitmqctl")
            .args([
                "-q",
                "list_queues",
                "name",
                "messages",
                "--formatter",
                "json",
            ])
            .output()
            .expect("rabbitmqctl");
        match serde_json::from_slice(&out.stdout) {
            Ok(rows) if out.status.success() => break rows,
            _ if std::time::Instant::now() < deadline => continue,
            _ => panic!(
                "rabbitmqctl list_queues failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    rows.iter()
        .find(|r| r["name"] == queue)
        .and_then(|r| r["messages"].as_u64())
        .unwrap_or_else(|| panic!("no queue {queue}"))
}

/// Retries expire while the work queue does not exist (deleted, or not
/// yet declared again after a migration): the hop back has no route.
/// Waits until the retry queue holds `expect_held` messages, none ready;
/// returns (applied, distinct).
async fn retries_expiring_while_the_work_queue_is_missing(
    queue_type: QueueType,
    expect_held: u64,
    expected: i64,
) -> (i64, i64) {
    let r = RetryPath::new("gone", queue_type, None).await;
    let expired_by = r.retry_ten().await;
    r.env
        .channel
        .queue_delete(r.queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(
        tokio::time::Instant::now() < expired_by,
        "the work queue was deleted after a retry expired"
    );
    // Every retry's TTL (a clock) runs out with no work queue to go to.
    tokio::time::sleep_until(expired_by + Duration::from_millis(500)).await;
    // Quorum: the expired retries are no longer ready but still in the
    // queue, waiting to be dead-lettered (rabbitmqctl's counts lag by a
    // few seconds). Classic: nothing waits.
    let retry_queue = r.retry_queue();
    wait_until("the retry queue to hold what expired", || async {
        all_messages(&retry_queue) == expect_held && depth(&r.env, &retry_queue).await == 0
    })
    .await;
    // The work queue comes back (a redeploy declares it).
    declare_topology(&r.env.amqp, &r.topology).await.unwrap();
    r.consume_until_quiet(expected).await
}

/// What makes the retry path loss-free: a quorum retry queue dead-letters
/// at-least-once, so retries with nowhere to go stay in it (counted by
/// `rabbitmqctl`, not ready) and reach the work queue once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_retries_are_held_while_the_work_queue_is_missing() {
    let (applied, distinct) =
        retries_expiring_while_the_work_queue_is_missing(QueueType::Quorum, 10, 10).await;
    assert_eq!((distinct, applied), (10, 10), "each applied once");
}

/// The same on classic queues: the broker drops the expired retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_retries_are_dropped_while_the_work_queue_is_missing() {
    let (applied, distinct) =
        retries_expiring_while_the_work_queue_is_missing(QueueType::Classic, 0, 0).await;
    assert_eq!((distinct, applied), (0, 0), "all 10 lost");
}

/// A message that comes back unacked `delivery_limit` times (a consumer
/// that crashes on it, a connection that keeps dropping) ends in
/// `<queue>.dlq` with the broker's reason; the consumer sees how often it
/// came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_coming_back_ends_in_the_dead_letter_queue() {
    let mut env = Env::new().await;
    let queue = format!("{}_limit", env.queue);
    let mut topology = TopologyConfig::new(&queue, &env.exchange, "limit.#");
    topology.delivery_limit = 3;
    declare_topology(&env.amqp, &topology).await.unwrap();
    env.delete_on_teardown(&queue);
    let poison = format!("p-{}", e2e::consumer::id());
    publish(&env, std::slice::from_ref(&poison), "limit.x").await;
    // Delivered and returned unacked until the broker gives up on it.
    let mut deliveries = 0;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let got = env
            .channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap();
        match got {
            Some(m) => {
                deliveries += 1;
                requeue(m).await;
            }
            None if depth(&env, &format!("{queue}.dlq")).await == 1 => break,
            None => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "never dead-lettered"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert_eq!(
        deliveries, 4,
        "delivered once, then again up to the limit of 3 redeliveries"
    );
    let dead = env.take(&format!("{queue}.dlq"), 1).await.remove(0);
    let death = dead
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let reason = match death.inner().get("x-death") {
        Some(AMQPValue::FieldArray(deaths)) => match deaths.as_slice().first() {
            Some(AMQPValue::FieldTable(t)) => match t.inner().get("reason") {
                Some(AMQPValue::LongString(r)) => {
                    String::from_utf8_lossy(r.as_bytes()).into_owned()
                }
                other => format!("{other:?}"),
            },
            other => format!("{other:?}"),
        },
        other => format!("{other:?}"),
    };
    assert_eq!(reason, "delivery_limit");

    // The consumer reads how often a message came back.
    let second = format!("s-{}", e2e::consumer::id());
    publish(&env, std::slice::from_ref(&second), "limit.x").await;
    for _ in 0..2 {
        let got = loop {
            if let Some(m) = env
                .channel
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
            {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        requeue(got).await;
    }
    let handler = RetryOnce {
        sql: format!("INSERT INTO {}.effects (event_id) VALUES ($1)", env.schema),
        delivery_counts: Arc::default(),
    };
    let mut cfg = env.config("svc");
    cfg.queue = queue.clone();
    let running = Running::start(Consumer::new(cfg, env.pool.clone(), handler.clone()).unwrap());
    wait_until("the second message applied", || async {
        env.count("{s}.effects").await == 1
    })
    .await;
    running.stop().await;
    assert_eq!(
        handler.delivery_counts.lock().unwrap().get(&second),
        Some(&2)
    );
    env.teardown().await;
}

/// A queue that exists as classic, declared as quorum (the default): one
/// error naming the queue and the argument, from the topology helper and
/// from a consumer's start-up, never retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_of_another_type_is_one_clear_error() {
    let mut env = Env::new().await;
    let queue = format!("{}_old", env.queue);
    let mut classic = TopologyConfig::new(&queue, &env.exchange, "old.#");
    classic.queue_type = QueueType::Classic;
    declare_topology(&env.amqp, &classic).await.unwrap();
    env.delete_on_teardown(&queue);
    // The helper's channel closed with the error; a fresh connection.
    let conn = lapin::Connection::connect(&e2e::consumer::amqp_url(), Default::default())
        .await
        .unwrap();
    let e = declare_topology(&conn, &TopologyConfig::new(&queue, &env.exchange, "old.#"))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::QueueMismatch { queue: q, .. } if *q == queue),
        "{e:?}"
    );
    assert!(!e.is_transient());
    let text = e.to_string();
    assert!(text.contains("inequivalent arg 'x-"), "{text}");
    assert!(text.contains("QueueType::Classic"), "{text}");
    let _ = conn.close(200, "bye".into()).await;

    let mut cfg = env.config("svc");
    cfg.queue = queue.clone();
    let consumer = Consumer::new(
        cfg,
        env.pool.clone(),
        RetryOnce {
            sql: String::new(),
            delivery_counts: Arc::default(),
        },
    )
    .unwrap();
    let ended = tokio::time::timeout(DEADLINE, consumer.run(Default::default()))
        .await
        .expect("a mismatch is not retried");
    assert!(
        matches!(&ended, Err(Error::QueueMismatch { queue: q, .. }) if *q == format!("{queue}.retry")),
        "{ended:?}"
    );
    assert_eq!(consumer.stats().connections, 0);
    env.teardown().await;
}
