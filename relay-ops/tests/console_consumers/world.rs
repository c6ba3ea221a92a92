//! What the consumer-page tests share: a consumer `stock` with its
//! queues and inbox (`World`), a real consumer of it (`Running`), and
//! archived events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::{TestBroker, TestDb, amqp_url, wait_until};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome, TopologyConfig};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use e2e::console::Console;

/// A consumer named `stock` with its topology (work, retry and
/// dead-letter queues, quorum) bound to the test's exchange, and its inbox
/// in the test's schema.
pub(crate) struct World {
    pub(crate) db: TestDb,
    pub(crate) broker: TestBroker,
    pub(crate) queue: String,
    pub(crate) conn: Connection,
}

impl World {
    pub(crate) async fn new(name: &str) -> World {
        let db = TestDb::producer(name).await;
        outbox_consumer::migrate(&db.pool, &db.schema)
            .await
            .expect("inbox");
        let broker = TestBroker::new(name, FieldTable::default()).await;
        let queue = format!("{}.stock", broker.queue);
        let conn = e2e::connect().await;
        outbox_consumer::declare_topology(
            &conn,
            &TopologyConfig::new(&queue, &broker.exchange, "order.*"),
        )
        .await
        .expect("topology");
        World {
            db,
            broker,
            queue,
            conn,
        }
    }

    pub(crate) async fn console(&self, extra: &[&str]) -> Console {
        let queue = format!("stock={}", self.queue);
        Console::start(&self.db, |c| {
            c.args(["--amqp-url", &amqp_url(), "--consumer-queue", &queue])
                .args(extra);
        })
        .await
    }

    /// A world whose queues are declared by hand: a classic work and
    /// retry queue, and a quorum DLQ with `x-delivery-limit` = `limit` (a
    /// quorum queue drops a message given back more than that many times
    /// when it has no dead-letter target: RabbitMQ 4's default is 20).
    pub(crate) async fn with_limited_dlq(name: &str, limit: i64) -> World {
        let db = TestDb::producer(name).await;
        let conn = e2e::connect().await;
        let queue = format!("test.{name}.{}", e2e::suffix());
        let ch = conn.create_channel().await.expect("channel");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for (q, a) in [
            (queue.clone(), FieldTable::default()),
            (format!("{queue}.retry"), FieldTable::default()),
            (format!("{queue}.dlq"), args),
        ] {
            ch.queue_declare(q.as_str().into(), durable, a)
                .await
                .expect("queue");
        }
        let broker = TestBroker::new(name, FieldTable::default()).await;
        World {
            db,
            broker,
            queue,
            conn,
        }
    }

    pub(crate) fn dlq(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    pub(crate) async fn publish(&self, queue: &str, props: BasicProperties, body: &str) {
        let ch = self.conn.create_channel().await.expect("channel");
        ch.confirm_select(Default::default())
            .await
            .expect("confirms");
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
        let _ = ch.close(200, "ok".into()).await;
    }

    /// A dead letter as the consumer leaves one: the event, and its reason.
    pub(crate) async fn dead_letter(&self, event_type: &str, reason: &str) -> String {
        let id = Uuid::new_v4().to_string();
        let mut h = FieldTable::default();
        h.insert(
            "x-dead-letter-reason".into(),
            AMQPValue::LongString(reason.into()),
        );
        h.insert(
            "x-dead-letter-consumer".into(),
            AMQPValue::LongString("stock".into()),
        );
        h.insert(
            "x-aggregate-type".into(),
            AMQPValue::LongString("order".into()),
        );
        h.insert("x-aggregate-id".into(), AMQPValue::LongString("o-1".into()));
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_type(event_type.into())
            .with_headers(h);
        self.publish(&self.dlq(), props, &format!("{{\"id\":\"{id}\"}}"))
            .await;
        id
    }

    /// A message the broker dead-letters itself (rejected without
    /// requeue from the work queue: `x-death` reason `rejected`).
    pub(crate) async fn rejected_by_the_broker(&self, event_type: &str) -> String {
        let id = Uuid::new_v4().to_string();
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_type(event_type.into());
        self.publish(&self.queue, props, "{}").await;
        let ch = self.conn.create_channel().await.expect("channel");
        let got = ch
            .basic_get(self.queue.as_str().into(), BasicGetOptions::default())
            .await
            .expect("get");
        let d = got.expect("the message just published").delivery;
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .expect("reject");
        let _ = ch.close(200, "ok".into()).await;
        id
    }

    /// Waits until `queue` holds `n` ready messages (a quorum queue's
    /// count in a passive declare lags a moment).
    pub(crate) async fn expect_depth(&self, queue: &str, n: u32) {
        wait_until(
            Duration::from_secs(20),
            &format!("{queue} to hold {n}"),
            || async { self.depth(queue).await == n },
        )
        .await;
    }

    pub(crate) async fn depth(&self, queue: &str) -> u32 {
        let ch = self.conn.create_channel().await.expect("channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = ch
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .expect("queue");
        let _ = ch.close(200, "ok".into()).await;
        q.message_count()
    }

    /// Takes every message of `queue` (acked): their message ids in order.
    pub(crate) async fn drain(&self, queue: &str) -> Vec<String> {
        let ch = self.conn.create_channel().await.expect("channel");
        let mut ids = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("get")
        {
            ids.push(
                m.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
            );
            m.delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .expect("ack");
        }
        ids
    }

    pub(crate) async fn cleanup(self) {
        let ch = self.conn.create_channel().await.expect("channel");
        for q in [
            self.queue.clone(),
            format!("{}.retry", self.queue),
            self.dlq(),
        ] {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self.conn.close(200, "ok".into()).await;
        self.broker.cleanup().await;
        self.db.cleanup().await;
    }
}

/// A real consumer `stock` of the world's queue; counts the handler's
/// calls per event id (the inbox keeps it from seeing one twice).
pub(crate) struct Running {
    pub(crate) calls: Arc<Mutex<HashMap<String, usize>>>,
    pub(crate) stop: CancellationToken,
}

#[derive(Clone)]
struct Recorder(Arc<Mutex<HashMap<String, usize>>>);

impl Running {
    /// The handler's calls so far, per event id.
    pub(crate) fn calls(&self) -> HashMap<String, usize> {
        self.calls.lock().unwrap().clone()
    }
}

impl Handler for Recorder {
    async fn handle(&self, _conn: &mut PgConnection, event: &Event) -> Outcome {
        *self
            .0
            .lock()
            .unwrap()
            .entry(event.id().to_owned())
            .or_default() += 1;
        Outcome::Ack
    }
}

impl World {
    pub(crate) async fn run_consumer(&self) -> Running {
        let calls = Arc::new(Mutex::new(HashMap::new()));
        let mut config = ConsumerConfig::new(amqp_url(), &self.queue, "stock");
        config.schema = self.db.schema.clone();
        let consumer = Consumer::new(
            config,
            e2e::pool("console-consumers", 4).await,
            Recorder(calls.clone()),
        )
        .expect("consumer");
        let stop = CancellationToken::new();
        tokio::spawn({
            let stop = stop.clone();
            async move { consumer.run(stop).await }
        });
        Running { calls, stop }
    }

    pub(crate) async fn processed(&self, ids: &[String]) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".inbox_processed WHERE consumer = 'stock' AND event_id = ANY($1)",
            self.db.schema
        )))
        .bind(ids)
        .fetch_one(&self.db.pool)
        .await
        .expect("inbox")
    }

    pub(crate) async fn mark_processed(&self, ids: &[String]) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{0}\".inbox_processed (consumer, event_id, event_at) SELECT 'stock', k, \"{0}\".inbox_event_time(k) FROM unnest($1::text[]) k",
            self.db.schema
        )))
        .bind(ids)
        .execute(&self.db.pool)
        .await
        .expect("inbox rows");
    }
}

/// Archived events of `n` orders published `minutes_ago`, one second
/// apart; returns their ids.
pub(crate) async fn archived(
    db: &TestDb,
    event_type: &str,
    n: i32,
    minutes_ago: i32,
) -> Vec<String> {
    let aggregate = if event_type.starts_with("Refund") {
        "refund"
    } else {
        "order"
    };
    sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_archive
             (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, published_at)
         SELECT gen_random_uuid(), $1, 'o-' || g, $2, jsonb_build_object('n', g), '{{\"x-tenant\": \"acme\"}}',
                now() - $4 * interval '1 minute', 1, now() - $4 * interval '1 minute' + g * interval '1 second'
         FROM generate_series(1, $3) g RETURNING id::text",
        db.schema
    )))
    .bind(aggregate)
    .bind(event_type)
    .bind(n)
    .bind(minutes_ago)
    .fetch_all(&db.pool)
    .await
    .expect("archived events")
}
