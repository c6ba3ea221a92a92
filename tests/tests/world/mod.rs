//! The one world of the fault suites (`faults`, `outages`, `matrix`,
//! `cluster`, `ordering`) and
//! its one oracle, [`World::judge`].
//!
//! A world is a producer schema, a consumer schema with an effects table
//! (one row per application, numbered in the order applied), an exchange
//! with the consumers' queue (or ordered partition queues), and the wire
//! watched: a counter of every message id the relays put on it and, for
//! worlds that say so, a log of each aggregate's sequence numbers in
//! arrival order. It lives on the test broker or on the three-node
//! cluster. The suites differ only in [`Options`].
//!
//! Every scenario ends with the oracle, judged once everything is quiet
//! (see [`World::judge`]).

// Each suite uses a part of the world.
#![allow(dead_code)]

mod broker;
mod judge;
mod parts;

use std::time::Duration;

use e2e::{Collector, ProcessLogs, SeqLog, TestBroker, TestDb, wait_until};
use lapin::types::FieldTable;
use outbox_consumer::{OrderedTopology, declare_ordered_topology};
use sqlx::AssertSqlSafe;

// What the suites take (each some of it).
#[allow(unused_imports)]
pub(crate) use {
    broker::Broker,
    judge::{Committed, Verdict},
    parts::{AConsumer, Consumers, Counts, Running},
};

/// Event counts scale with `FAULT_SCALE` (default 1; `make soak` uses 10).
pub(crate) fn scale() -> usize {
    std::env::var("FAULT_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1usize)
        .max(1)
}

pub(crate) fn scaled(n: usize) -> usize {
    n * scale()
}

/// Deadlines grow with the scale too.
pub(crate) fn deadline() -> Duration {
    Duration::from_secs(120 * scale() as u64)
}

/// How one suite's worlds differ from another's.
pub(crate) struct Options {
    /// The test broker, or the cluster.
    pub(crate) broker: Broker,
    /// Consumers apply ordered aggregates by their sequence numbers
    /// (`Sequencing::by_sequence`, deferrals through `<queue>.retry`).
    pub(crate) ordered: bool,
    /// Ordered partitions: this many single-active-consumer queues behind
    /// a consistent-hash exchange, one consumer each (ordered), instead of
    /// the one queue.
    pub(crate) partitions: Option<u16>,
    /// The consumers' queue bounded to this many messages (cluster only).
    pub(crate) max_length: Option<u32>,
    /// Watch each aggregate's sequence numbers on the wire (test broker
    /// only): the oracle checks the relays' own order.
    pub(crate) wire_order: bool,
    /// The consumers the oracle starts when a requeue left work behind are
    /// `fault-consumer` processes (on node 0), not in-process ones.
    pub(crate) consumer_processes: bool,
    /// The in-process relays' confirm and broker timeouts.
    pub(crate) relay_timeout: Duration,
    /// Bound on every wait of the oracle.
    pub(crate) deadline: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            broker: Broker::Single,
            ordered: false,
            partitions: None,
            max_length: None,
            wire_order: false,
            consumer_processes: false,
            relay_timeout: Duration::from_secs(2),
            deadline: deadline(),
        }
    }
}

/// One scenario's world.
pub(crate) struct World {
    pub(crate) db: TestDb,
    pub(crate) consumer_schema: String,
    pub(crate) nodes: Broker,
    pub(crate) broker: TestBroker,
    /// The queues the consumers drain: the broker's queue, or the ordered
    /// partitions.
    pub(crate) queues: Vec<String>,
    /// The partitions' consistent-hash exchange.
    hash_exchange: Option<String>,
    /// Every message id the relays put on the wire, copies counted.
    pub(crate) wire: Collector,
    pub(crate) wire_queue: String,
    /// Each aggregate's sequence numbers on the wire, in arrival order
    /// ([`Options::wire_order`]), and its queue.
    wire_seqs: Option<(SeqLog, String)>,
    /// Consumers apply ordered aggregates by their sequence numbers.
    pub(crate) ordered: bool,
    consumer_processes: bool,
    relay_timeout: Duration,
    pub(crate) deadline: Duration,
    /// The relays' and consumers' stderr, shown when the scenario fails.
    logs: ProcessLogs,
}

impl World {
    /// A world on the test broker.
    pub(crate) async fn new(prefix: &str) -> Self {
        Self::with(TestDb::producer(prefix).await, prefix, Options::default()).await
    }

    /// A world whose producers write to the write-ahead log and whose
    /// relays read the schema's slot (`--capture wal`).
    pub(crate) async fn wal(prefix: &str) -> Self {
        Self::with(
            TestDb::producer_wal(prefix).await,
            prefix,
            Options::default(),
        )
        .await
    }

    pub(crate) async fn with(db: TestDb, prefix: &str, options: Options) -> Self {
        let Options {
            broker: nodes,
            ordered,
            partitions,
            max_length,
            wire_order,
            consumer_processes,
            relay_timeout,
            deadline,
        } = options;
        let consumer_schema = format!("{}_c", db.schema);
        outbox_consumer::migrate(&db.pool, &consumer_schema)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE \"{consumer_schema}\".effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT now(), n bigserial)"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let broker = nodes.declare(prefix, max_length).await;
        let conn = nodes.connect().await;
        let (queues, hash_exchange) = match partitions {
            None => (vec![broker.queue.clone()], None),
            Some(n) => {
                assert!(
                    nodes.cluster().is_none(),
                    "ordered partitions are a test broker world's"
                );
                // The relay's exchange → consistent hash on x-aggregate-id
                // → `n` single-active-consumer queues.
                let name = format!("{}.c", broker.exchange);
                let t = OrderedTopology::new(&name, &broker.exchange, "#", n);
                let queues = declare_ordered_topology(&conn, &t).await.unwrap();
                (queues, Some(name))
            }
        };
        // A second queue on the same exchange counts what the relays put
        // on the wire, duplicates included.
        let wire_queue = format!("{}.wire", broker.queue);
        e2e::declare_tap_queue(&conn, &broker.exchange, &wire_queue, "#", nodes.tap_args()).await;
        let wire = Collector::start_on(&nodes.urls(), &wire_queue);
        // A third logs each aggregate's sequence numbers as they arrive.
        let wire_seqs = if wire_order {
            assert!(
                nodes.cluster().is_none(),
                "the sequence log reads the test broker"
            );
            let q = format!("{}.seqs", broker.queue);
            e2e::declare_tap_queue(&conn, &broker.exchange, &q, "#", FieldTable::default()).await;
            Some((SeqLog::start(&q), q))
        } else {
            None
        };
        let _ = conn.close(200, "ok".into()).await;
        Self {
            logs: ProcessLogs::new(&db.schema),
            db,
            consumer_schema,
            nodes,
            broker,
            queues,
            hash_exchange,
            wire,
            wire_queue,
            wire_seqs,
            ordered: ordered || partitions.is_some(),
            consumer_processes,
            relay_timeout,
            deadline,
        }
    }

    /// The cluster's (or the test broker's) URLs starting with node
    /// `first`.
    pub(crate) fn urls_from(&self, first: usize) -> String {
        self.nodes.urls_from(first)
    }

    /// The cluster of a cluster world.
    pub(crate) fn cluster(&self) -> &e2e::cluster::Cluster {
        self.nodes.cluster().expect("a cluster world")
    }

    /// The node leading the world's work queue (a quorum queue on the
    /// cluster).
    pub(crate) async fn queue_leader(&self) -> usize {
        self.cluster()
            .leader(&self.broker.queue)
            .await
            .unwrap()
            .expect("the work queue has a leader")
    }

    /// Each aggregate's sequence numbers on the wire
    /// ([`Options::wire_order`]).
    pub(crate) fn wire_seqs(&self) -> &SeqLog {
        &self
            .wire_seqs
            .as_ref()
            .expect("a world watching the order")
            .0
    }

    /// The retry queues of the world's queues, where they exist: ordered
    /// consumers declare them, and so does the cluster's topology.
    fn retry_queues(&self) -> Vec<String> {
        if self.ordered || self.nodes.cluster().is_some() {
            self.queues.iter().map(|q| format!("{q}.retry")).collect()
        } else {
            Vec::new()
        }
    }

    /// (effects applied, distinct events applied).
    pub(crate) async fn effects(&self) -> (i64, i64) {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT event_id) FROM \"{}\".effects",
            self.consumer_schema
        )))
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Ready messages in the world's (first) queue.
    pub(crate) async fn depth(&self) -> u32 {
        self.depth_of(&self.queues[0]).await
    }

    /// Ready messages in `queue`, asked of any node that answers (0 while
    /// none does).
    pub(crate) async fn depth_of(&self, queue: &str) -> u32 {
        match self.nodes.try_connect().await {
            Ok(conn) => {
                let d = e2e::depth(&conn, queue).await.0;
                let _ = conn.close(200, "ok".into()).await;
                d
            }
            Err(_) => 0,
        }
    }

    /// Waits until every committed event has left the outbox (published or
    /// dead-lettered; the oracle tells which): the table, and the log up to
    /// its end now.
    pub(crate) async fn outbox_drained(&self) {
        self.db.drained(self.deadline).await;
    }

    /// Waits for a relay batch in flight: a claim holding rows (table), or
    /// events just published with more of the log's backlog behind them
    /// (WAL: no row to see). Returns the committed events not published
    /// yet (table: rows left).
    pub(crate) async fn in_flight(&self, committed: usize) -> usize {
        if self.is_wal() {
            let seen = self.wire.distinct();
            wait_until(self.deadline, "the log's reader publishing", || async {
                self.wire.distinct() > seen
            })
            .await;
            committed.saturating_sub(self.wire.distinct())
        } else {
            let outbox = format!("\"{}\".outbox", self.db.schema);
            wait_until(self.deadline, "a batch in flight", || async {
                e2e::locked_rows(&self.db.pool, &outbox).await > 0
            })
            .await;
            self.db.count("outbox").await as usize
        }
    }

    pub(crate) async fn cleanup(self) {
        self.wire.stop();
        let mut queues = vec![self.wire_queue.clone()];
        if let Some((_, q)) = &self.wire_seqs {
            queues.push(q.clone());
        }
        let retries = self.retry_queues();
        let partitioned = self.hash_exchange.is_some();
        for q in &self.queues {
            if partitioned {
                queues.push(q.clone());
            }
            // The cluster's topology declares them; ordered consumers too.
            if !retries.is_empty() {
                queues.push(format!("{q}.retry"));
                queues.push(format!("{q}.dlq"));
            }
        }
        let exchanges: Vec<String> = self.hash_exchange.iter().cloned().collect();
        self.nodes.cleanup(self.broker, &queues, &exchanges).await;
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.consumer_schema
        )))
        .execute(&self.db.pool)
        .await;
        self.db.cleanup().await;
    }
}
