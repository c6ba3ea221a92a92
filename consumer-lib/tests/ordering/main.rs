//! Ordered consumption: sequenced events are applied per aggregate in
//! sequence order, whatever order, duplicates and failures they come with;
//! and the routing scheme that keeps an aggregate on one queue. This file
//! is what the scenarios share (messages, a recording handler, the
//! effects read back); `sequence.rs` applies sequences, `partitions.rs`
//! routes aggregates to partition queues.

mod partitions;
mod sequence;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use e2e::consumer::{Env, Running, amqp_url, db_url, id, wait_until};
use futures_util::StreamExt as _;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use outbox::wire;
use outbox_consumer::{
    BatchHandler, BatchOutcome, Consumer, ConsumerConfig, Error, Event, Handler, OrderedTopology,
    Outcome, Sequencing, declare_ordered_topology,
};
use sqlx::{AssertSqlSafe, PgConnection};

/// One message to publish: its id, aggregate id and `x-aggregate-seq`
/// value (`None`: an unordered event), and an `x-retry-count` it already
/// carries (as if a handler had retried it before).
struct Msg {
    id: String,
    aggregate: String,
    seq: Option<AMQPValue>,
    retry_count: Option<i64>,
}

fn seq(aggregate: &str, n: i64) -> Msg {
    Msg {
        id: id(),
        aggregate: aggregate.to_owned(),
        seq: Some(AMQPValue::LongLongInt(n)),
        retry_count: None,
    }
}

fn unordered(aggregate: &str) -> Msg {
    Msg {
        id: id(),
        aggregate: aggregate.to_owned(),
        seq: None,
        retry_count: None,
    }
}

fn properties(m: &Msg) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(
        wire::HEADER_AGGREGATE_TYPE.into(),
        AMQPValue::LongString("order".into()),
    );
    if !m.aggregate.is_empty() {
        h.insert(
            wire::HEADER_AGGREGATE_ID.into(),
            AMQPValue::LongString(m.aggregate.as_str().into()),
        );
    }
    if let Some(s) = &m.seq {
        h.insert(wire::HEADER_AGGREGATE_SEQ.into(), s.clone());
    }
    if let Some(n) = m.retry_count {
        h.insert(wire::HEADER_RETRY_COUNT.into(), AMQPValue::LongLongInt(n));
    }
    BasicProperties::default()
        .with_message_id(m.id.as_str().into())
        .with_type("OrderChanged".into())
        .with_delivery_mode(2)
        .with_headers(h)
}

/// Publishes `msgs` in order to `exchange` with `routing_key` and waits for
/// every confirm.
async fn publish_to(env: &Env, exchange: &str, routing_key: &str, msgs: &[Msg]) {
    let mut confirms = Vec::new();
    for m in msgs {
        let c = env
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                br#"{}"#,
                properties(m),
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
}

/// Publishes straight to the test's queue (default exchange).
async fn publish(env: &Env, msgs: &[Msg]) {
    publish_to(env, "", &env.queue, msgs).await;
}

/// Records each applied event (aggregate, seq, retry and deferral
/// counts) in `applied`, in apply order. Fails with `Retry` as many times
/// as `fail` says for its (aggregate, seq) pairs, always with `Reject` for
/// those in `reject`.
struct Recorder {
    sql: String,
    fail: Mutex<HashMap<(String, i64), u32>>,
    reject: HashSet<(String, i64)>,
}

impl Recorder {
    /// Creates the `applied` table and a recorder writing to it.
    async fn new(env: &Env) -> Recorder {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {}.applied (n bigserial PRIMARY KEY, aggregate text NOT NULL, \
             seq bigint, retry_count int NOT NULL, deferral_count int NOT NULL, \
             event_id text NOT NULL)",
            env.schema
        )))
        .execute(&env.pool)
        .await
        .unwrap();
        Recorder::on(env)
    }

    /// Another recorder on the same table (another instance).
    fn on(env: &Env) -> Recorder {
        Recorder {
            sql: format!(
                "INSERT INTO {}.applied (aggregate, seq, retry_count, deferral_count, event_id) \
                 VALUES ($1, $2, $3, $4, $5)",
                env.schema
            ),
            fail: Mutex::default(),
            reject: HashSet::new(),
        }
    }

    fn fail_once(self, aggregate: &str, seq: i64) -> Self {
        self.fail_times(aggregate, seq, 1)
    }

    fn fail_times(self, aggregate: &str, seq: i64, times: u32) -> Self {
        self.fail
            .lock()
            .unwrap()
            .insert((aggregate.to_owned(), seq), times);
        self
    }
}

impl Handler for Recorder {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let aggregate = event.aggregate_id().unwrap_or_default().into_owned();
        let seq = event.aggregate_seq();
        // The effect is written first, so a failure must roll it back.
        if let Err(e) = sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(&aggregate)
            .bind(seq)
            .bind(event.retry_count() as i32)
            .bind(event.deferral_count() as i32)
            .bind(event.id())
            .execute(conn)
            .await
        {
            return Outcome::retry(e);
        }
        let key = (aggregate, seq.unwrap_or(0));
        if self.reject.contains(&key) {
            return Outcome::reject("refused by the test");
        }
        if let Some(left) = self.fail.lock().unwrap().get_mut(&key)
            && *left > 0
        {
            *left -= 1;
            return Outcome::retry("transient failure injected by the test");
        }
        Outcome::Ack
    }
}

/// The sequence numbers applied for `aggregate`, in apply order
/// (sequenced events only).
async fn applied(env: &Env, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT seq FROM {}.applied WHERE aggregate = $1 AND seq IS NOT NULL ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// Retry counts of the events applied for `aggregate`, in apply order.
async fn retry_counts(env: &Env, aggregate: &str) -> Vec<i32> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT retry_count FROM {}.applied WHERE aggregate = $1 ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

/// Deferral counts of the events applied for `aggregate`, in apply order.
async fn deferral_counts(env: &Env, aggregate: &str) -> Vec<i32> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT deferral_count FROM {}.applied WHERE aggregate = $1 ORDER BY n",
        env.schema
    )))
    .bind(aggregate)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

async fn last_seq(env: &Env, aggregate: &str) -> Option<i64> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT last_seq FROM {}.inbox_sequences WHERE consumer = 'svc' AND aggregate_id = $1",
        env.schema
    )))
    .bind(aggregate)
    .fetch_optional(&env.pool)
    .await
    .unwrap()
}

async fn wait_applied(env: &Env, aggregate: &str, n: usize) {
    wait_until(&format!("{n} events of {aggregate} applied"), || async {
        applied(env, aggregate).await.len() >= n
    })
    .await;
}

fn ordered(env: &Env, accept_first_seen: bool) -> ConsumerConfig {
    let mut c = env.config("svc");
    c.sequencing = Sequencing::BySequence { accept_first_seen };
    c.retry_delay = Duration::from_millis(20);
    c.max_retry_delay = Duration::from_millis(200);
    c
}

fn reason(m: &lapin::message::BasicGetMessage) -> String {
    match m
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(wire::HEADER_DEAD_LETTER_REASON))
    {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("no dead-letter reason: {other:?}"),
    }
}

/// Dead letters of the test queue by message id, waiting for `n`.
async fn dead_letters(env: &Env, n: usize) -> BTreeMap<String, String> {
    env.take(&format!("{}.dlq", env.queue), n)
        .await
        .iter()
        .map(|m| {
            let id = m.properties.message_id().as_ref().unwrap().to_string();
            (id, reason(m))
        })
        .collect()
}
