//! The consumer library's test world ([`Env`]): a schema of its own
//! ([`TestDb`], with the inbox), an exchange and queues per test,
//! publishing with the contract's properties, and a running consumer
//! ([`Running`]).

use std::future::Future;
use std::time::Duration;

use crate::TestDb;
use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use outbox_consumer::{Consumer, ConsumerConfig, TopologyConfig};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a consumer test waits for anything.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub use crate::{amqp_url, database_url as db_url};

/// One test's world: its own schema (`e2e::TestDb`), exchange and
/// queues.
pub struct Env {
    db: TestDb,
    /// The test's schema's pool.
    pub pool: PgPool,
    /// The test's schema (inbox migrated, tables `effects` and `stock`).
    pub schema: String,
    /// A broker connection of the test's own.
    pub amqp: Connection,
    /// A confirm-mode channel on it.
    pub channel: Channel,
    /// The test's topic exchange.
    pub exchange: String,
    /// The work queue, bound to it with `#`.
    pub queue: String,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Env {
    /// A world with the inbox at the current migration.
    pub async fn new() -> Env {
        Self::migrated(true).await
    }

    /// An environment whose inbox is at version 2 (the release before the
    /// inbox partitioned by time): version 1's `inbox` and the sequences,
    /// applied as that release applied them.
    #[allow(dead_code)]
    pub async fn at_version_2() -> Env {
        Self::migrated(false).await
    }

    async fn migrated(latest: bool) -> Env {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let db = TestDb::empty("c").await;
        let (pool, schema) = (db.pool.clone(), db.schema.clone());
        if latest {
            outbox_consumer::migrate(&pool, &schema).await.unwrap();
        } else {
            let mut tx = pool.begin().await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE TABLE {schema}.outbox_toolkit_migrations (
                     migration_set text NOT NULL, version integer NOT NULL, name text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (migration_set, version));
                 INSERT INTO {schema}.outbox_toolkit_migrations (migration_set, version, name)
                 VALUES ('consumer', 1, 'inbox'), ('consumer', 2, 'inbox_sequences');
                 SET LOCAL search_path = {schema};"
            )))
            .execute(&mut *tx)
            .await
            .unwrap();
            for sql in [
                include_str!("../../../migrations/consumer/0001_inbox.sql"),
                include_str!("../../../migrations/consumer/0002_inbox_sequences.sql"),
            ] {
                sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
            }
            tx.commit().await.unwrap();
        }
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {schema}.effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
             CREATE TABLE {schema}.stock (sku text PRIMARY KEY, qty bigint NOT NULL);
             INSERT INTO {schema}.stock VALUES ('A', 100000);"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = amqp.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let exchange = format!("t_c_x_{suffix}");
        let queue = format!("t_c_q_{suffix}");
        let mut env = Env {
            db,
            pool,
            schema,
            amqp,
            channel,
            exchange,
            queue: queue.clone(),
            queues: Vec::new(),
            exchanges: Vec::new(),
        };
        env.add_queue(&queue).await;
        env
    }

    /// Declares another queue bound to the test exchange (a second
    /// subscriber), deleted at teardown.
    pub async fn add_queue(&mut self, queue: &str) {
        outbox_consumer::declare_topology(
            &self.amqp,
            &TopologyConfig::new(queue, &self.exchange, "#"),
        )
        .await
        .unwrap();
        self.delete_on_teardown(queue);
    }

    /// Deletes `queue`, `<queue>.retry` and `<queue>.dlq` at teardown.
    pub fn delete_on_teardown(&mut self, queue: &str) {
        for q in [
            queue.to_owned(),
            format!("{queue}.retry"),
            format!("{queue}.dlq"),
        ] {
            self.queues.push(q);
        }
    }

    /// Deletes `exchange` at teardown.
    pub fn delete_exchange_on_teardown(&mut self, exchange: &str) {
        self.exchanges.push(exchange.to_owned());
    }

    /// A consumer of the work queue named `consumer_name`, retrying after 100 ms.
    pub fn config(&self, consumer_name: &str) -> ConsumerConfig {
        let mut c = {
            let mut c = ConsumerConfig::new(amqp_url(), &self.queue, consumer_name);
            c.schema = self.schema.to_string();
            c
        };
        c.retry_delay = Duration::from_millis(100);
        c
    }

    /// Publishes messages to the exchange with the contract's properties
    /// and waits for every confirm. `None` id: no message_id.
    pub async fn publish_all(&self, messages: &[(Option<String>, Vec<u8>)]) {
        let mut confirms = Vec::with_capacity(messages.len());
        for (id, body) in messages {
            let mut headers = FieldTable::default();
            headers.insert(
                "x-aggregate-type".into(),
                AMQPValue::LongString("order".into()),
            );
            headers.insert("x-aggregate-id".into(), AMQPValue::LongString("o-1".into()));
            headers.insert(
                "traceparent".into(),
                AMQPValue::LongString(
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                ),
            );
            let mut props = BasicProperties::default()
                .with_type("OrderPlaced".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_headers(headers);
            if let Some(id) = id {
                props = props.with_message_id(id.as_str().into());
            }
            let c = self
                .channel
                .basic_publish(
                    self.exchange.as_str().into(),
                    "order.OrderPlaced".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body,
                    props,
                )
                .await
                .unwrap();
            confirms.push(c);
        }
        for c in confirms {
            assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
        }
    }

    /// Publishes one message (see [`Env::publish_all`]).
    pub async fn publish(&self, id: Option<&str>, body: &str) {
        self.publish_all(&[(id.map(str::to_owned), body.as_bytes().to_vec())])
            .await;
    }

    /// Takes `n` messages from `queue`, waiting up to the deadline.
    pub async fn take(&self, queue: &str, n: usize) -> Vec<BasicGetMessage> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while got.len() < n {
            match self
                .channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                Some(m) => got.push(m),
                None => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "only {} of {n} messages in {queue}",
                        got.len()
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        got
    }

    /// `SELECT count(*) FROM` `sql_from_where`, its `{s}` the schema.
    pub async fn count(&self, sql_from_where: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {}",
            sql_from_where.replace("{s}", &self.schema)
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Deletes the test's queues and exchanges and drops its schema.
    pub async fn teardown(self) {
        for q in &self.queues {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for x in self.exchanges.iter().chain([&self.exchange]) {
            let _ = self
                .channel
                .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.amqp.close(200, "bye".into()).await;
        self.db.cleanup().await;
    }
}

/// [`crate::wait_until`] with the consumer tests' [`DEADLINE`].
pub async fn wait_until<F, Fut>(what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    crate::wait_until(DEADLINE, what, cond).await;
}

/// A running consumer.
pub struct Running {
    /// The consumer.
    pub consumer: Consumer,
    /// Cancels its run.
    pub shutdown: CancellationToken,
    /// Its run.
    pub task: JoinHandle<outbox_consumer::Result<()>>,
}

impl Running {
    /// Runs `consumer` in a task.
    pub fn start(consumer: Consumer) -> Running {
        let shutdown = CancellationToken::new();
        let (c, s) = (consumer.clone(), shutdown.clone());
        let task = tokio::spawn(async move { c.run(s).await });
        Running {
            consumer,
            shutdown,
            task,
        }
    }

    /// Stops it and waits (bounded) for its run to end cleanly.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

/// A fresh event id (UUIDv7).
pub fn id() -> String {
    uuid::Uuid::now_v7().to_string()
}
