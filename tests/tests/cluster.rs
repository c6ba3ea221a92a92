//! The pipeline on a three-node RabbitMQ cluster (`make cluster`) with
//! quorum queues, while nodes fail. The relay and two consumer processes
//! are each connected to a different node and given every node's URL.
//! Every fault lands on work in flight (a relay batch holds outbox rows,
//! the work queue holds messages); the oracle is the fault suite's, judged
//! once everything is quiet: committed ids = applied effects, none twice.
//! Duplicates on the wire and the time from each fault until publishing
//! resumed are printed.
//!
//! `make test` runs these (`cluster_` prefix) alone, after the rest: they
//! stop and start the cluster's nodes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e::cluster::Cluster;
use e2e::{
    Collector, KillOnDrop, TestDb, connect_any, database_url, settled_depth, suffix, wait_until,
};
use lapin::types::{AMQPValue, FieldTable};
use nix::sys::signal::Signal;
use outbox_consumer::{TopologyConfig, declare_topology};
use outbox_relay::{Relay, RelayConfig};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(120);

/// One test's world on the cluster: its own schemas, exchange and queues.
struct World {
    cluster: Cluster,
    db: TestDb,
    consumer_schema: String,
    exchange: String,
    queue: String,
    wire: Collector,
    wire_queue: String,
}

impl World {
    async fn new(prefix: &str, topology: impl FnOnce(&mut TopologyConfig)) -> Self {
        let cluster = Cluster::local();
        cluster.ensure_started().await.expect("make cluster");
        let db = TestDb::producer(prefix).await;
        let consumer_schema = format!("{}_c", db.schema);
        outbox_consumer::migrate(&db.pool, &consumer_schema)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE \"{consumer_schema}\".effects (event_id text NOT NULL)"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let s = suffix();
        let exchange = format!("test.{prefix}.{s}");
        let queue = format!("test.{prefix}.{s}.q");
        let conn = connect_any(&cluster.urls().join(",")).await.unwrap();
        let mut t = TopologyConfig::new(&queue, &exchange, "#");
        topology(&mut t);
        declare_topology(&conn, &t).await.unwrap();
        // A quorum queue of its own counts what reached the wire.
        let wire_queue = format!("{queue}.wire");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        e2e::declare_tap_queue(&conn, &exchange, &wire_queue, "#", args).await;
        let _ = conn.close(200, "ok".into()).await;
        let wire = Collector::start_on(&cluster.urls().join(","), &wire_queue);
        Self {
            cluster,
            db,
            consumer_schema,
            exchange,
            queue,
            wire,
            wire_queue,
        }
    }

    /// The cluster's URLs starting with node `first`.
    fn urls_from(&self, first: usize) -> String {
        let urls = self.cluster.urls();
        (0..urls.len())
            .map(|k| urls[(first + k) % urls.len()].clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    async fn relay(&self) -> (Relay, CancellationToken, tokio::task::JoinHandle<()>) {
        let pool = e2e::pool(&format!("relay-{}", suffix()), 4).await;
        let mut config = RelayConfig::default();
        config.amqp_url = self.urls_from(0).into();
        config.schema = self.db.schema.clone();
        config.default_exchange = self.exchange.clone();
        config.declare_exchange = None;
        config.batch_size = 100;
        config.poll_interval = Duration::from_millis(200);
        config.confirm_timeout = Duration::from_secs(5);
        config.broker_timeout = Duration::from_secs(5);
        config.reconnect_min = Duration::from_millis(50);
        config.reconnect_max = Duration::from_millis(500);
        let relay = Relay::new(pool, config).await.unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (relay, stop) = (relay.clone(), stop.clone());
            async move { relay.run(stop).await.expect("the relay ends cleanly") }
        });
        (relay, stop, task)
    }

    /// A consumer process connected first to node `first`.
    fn consumer(&self, first: usize) -> KillOnDrop {
        let child = Command::new(env!("CARGO_BIN_EXE_fault-consumer"))
            .env("DATABASE_URL", database_url())
            .env("AMQP_URL", self.urls_from(first))
            .env("SCHEMA", &self.consumer_schema)
            .env("QUEUE", &self.queue)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        KillOnDrop(child)
    }

    async fn applied(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(DISTINCT event_id) FROM \"{}\".effects",
            self.consumer_schema
        )))
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Ready messages in the work queue, asked of any node that answers.
    async fn depth(&self) -> u32 {
        self.depth_of(&self.queue).await
    }

    /// Ready messages in `queue` (0 while no node answers).
    async fn depth_of(&self, queue: &str) -> u32 {
        match connect_any(&self.cluster.urls().join(",")).await {
            Ok(conn) => {
                let d = e2e::depth(&conn, queue).await.0;
                let _ = conn.close(200, "ok".into()).await;
                d
            }
            Err(_) => 0,
        }
    }

    /// Quiet, then the oracle. `consumers` are stopped with SIGTERM once
    /// the queue is empty; a fresh one drains whatever a requeue left.
    async fn judge(
        &self,
        consumers: Vec<KillOnDrop>,
        committed: &[String],
        scenario: &str,
    ) -> usize {
        let conn = connect_any(&self.cluster.urls().join(",")).await.unwrap();
        let mut consumers = consumers;
        // Retries still on their way back (waiting out their delay, or to
        // be dead-lettered into the work queue) count as work left.
        let retry_queue = format!("{}.retry", self.queue);
        wait_until(
            DEADLINE,
            &format!("{scenario}: the retry path to empty"),
            || async { self.cluster.messages(&retry_queue).await.ok() == Some(0) },
        )
        .await;
        loop {
            let end = std::time::Instant::now() + DEADLINE;
            wait_until(
                DEADLINE,
                &format!("{scenario}: the queue to empty"),
                || async { e2e::depth(&conn, &self.queue).await.0 == 0 },
            )
            .await;
            for mut c in consumers.drain(..) {
                let code = e2e::stop_child(&mut c, Signal::SIGTERM, DEADLINE).await;
                assert_eq!(code, Some(0), "{scenario}: a consumer did not stop cleanly");
            }
            if settled_depth(&conn, &self.queue, end).await == 0
                && self.cluster.messages(&retry_queue).await.ok() == Some(0)
            {
                break;
            }
            consumers.push(self.consumer(0));
        }
        let _ = conn.close(200, "ok".into()).await;
        self.wire.drain(DEADLINE).await;
        let applied: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT event_id FROM \"{}\".effects",
            self.consumer_schema
        )))
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        e2e::assert_applied_once(&applied, committed, scenario);
        assert_eq!(
            self.wire.distinct(),
            committed.len(),
            "{scenario}: the wire count"
        );
        let dups = self.wire.duplicates();
        println!(
            "{scenario}: events {}, duplicates on the wire {dups}, effects applied {}",
            committed.len(),
            applied.len()
        );
        dups
    }

    async fn cleanup(self) {
        self.wire.stop();
        if let Ok(conn) = connect_any(&self.cluster.urls().join(",")).await
            && let Ok(ch) = conn.create_channel().await
        {
            for q in [
                self.queue.clone(),
                format!("{}.retry", self.queue),
                format!("{}.dlq", self.queue),
                self.wire_queue.clone(),
            ] {
                let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
            }
            let _ = ch
                .exchange_delete(self.exchange.as_str().into(), Default::default())
                .await;
            let _ = conn.close(200, "ok".into()).await;
        }
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.consumer_schema
        )))
        .execute(&self.db.pool)
        .await;
        self.db.cleanup().await;
    }
}

/// Waits until a relay batch holds outbox rows: a broker fault now lands
/// on a batch being published and confirmed.
async fn relay_in_flight(w: &World, what: &str) {
    let outbox = format!("\"{}\".outbox", w.db.schema);
    wait_until(
        DEADLINE,
        &format!("a relay batch in flight before {what}"),
        || async { e2e::locked_rows(&w.db.pool, &outbox).await > 0 },
    )
    .await;
}

/// Waits until the relay has published more than two batches since
/// `before`; returns how long that took from `since`.
async fn publishing_resumed(relay: &Relay, before: u64, since: Instant, what: &str) -> Duration {
    wait_until(
        DEADLINE,
        &format!("publishing to resume after {what}"),
        || async { relay.published() > before + 200 },
    )
    .await;
    since.elapsed()
}

/// Index of the node whose `host:port` is `node`.
fn node_index(node: &str) -> usize {
    let port: u16 = node.rsplit(':').next().unwrap().parse().unwrap();
    (port - 5701) as usize
}

/// (a) the relay's node SIGKILLed, (b) the work queue's leader SIGKILLed,
/// (c) every node restarted one after another, (d) each consumer
/// SIGKILLed, all while events are committed and flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_node_failures_lose_nothing() {
    let w = World::new("cl_nodes", |_| {}).await;
    let mut ids = w.db.produce(10_000, 500, Duration::ZERO).await;
    let (relay, relay_stop, relay_task) = w.relay().await;
    let mut consumers = vec![w.consumer(1), w.consumer(2)];
    let stop_producing = CancellationToken::new();
    // 50 events per transaction, 100 ms apart: a little under 500/s.
    let producer =
        w.db.produce_until(stop_producing.clone(), 50, Duration::from_millis(100));
    let mut report = Vec::new();

    // (a) The node the relay is connected to.
    relay_in_flight(&w, "killing the relay's node").await;
    let node = node_index(&relay.health().broker_node().expect("connected"));
    let killed = Instant::now();
    w.cluster.kill(node).await.unwrap();
    // A batch confirmed just before the node died may still be counted
    // after the kill: publishing resumed is counted from the reconnect.
    wait_until(
        DEADLINE,
        "the relay to reconnect to another node",
        || async {
            relay
                .health()
                .broker_node()
                .is_some_and(|n| node_index(&n) != node)
        },
    )
    .await;
    let before = relay.published();
    let t = publishing_resumed(&relay, before, killed, "the relay's node was killed").await;
    let moved = relay.health().broker_node().unwrap();
    assert_ne!(node_index(&moved), node, "the relay moved to another node");
    // `outbox-relay status` says so too (written at the next lease round).
    let schema = outbox::Ident::new("schema", &w.db.schema).unwrap();
    wait_until(DEADLINE, "status to name the relay's new node", || async {
        outbox_relay::admin::status(&w.db.pool, &schema)
            .await
            .unwrap()
            .relays
            .iter()
            .any(|r| r.broker.as_deref() == Some(moved.as_str()))
    })
    .await;
    report.push(format!(
        "relay's node {node} SIGKILLed: publishing resumed after {:.2} s (now on {moved})",
        t.as_secs_f64()
    ));
    w.cluster.start(node).await.unwrap();

    // (b) The node leading the work queue.
    relay_in_flight(&w, "killing the queue's leader").await;
    let leader = w.cluster.leader(&w.queue).await.unwrap().expect("a leader");
    let before = relay.published();
    w.cluster.kill(leader).await.unwrap();
    let t = publishing_resumed(&relay, before, Instant::now(), "the leader was killed").await;
    report.push(format!(
        "work queue's leader {leader} SIGKILLed: publishing resumed after {:.2} s",
        t.as_secs_f64()
    ));
    w.cluster.start(leader).await.unwrap();

    // (c) Every node restarted, one after another.
    for n in 0..3 {
        relay_in_flight(&w, "a rolling restart").await;
        let before = relay.published();
        let since = Instant::now();
        w.cluster.stop(n).await.unwrap();
        let t = publishing_resumed(&relay, before, since, "a node stopped").await;
        w.cluster.start(n).await.unwrap();
        report.push(format!(
            "rolling restart, node {n} stopped: publishing resumed after {:.2} s",
            t.as_secs_f64()
        ));
    }

    // (d) Each consumer SIGKILLed while the queue holds work, restarted.
    for i in 0..2 {
        // Lands on deliveries the consumers hold unacknowledged.
        wait_until(
            DEADLINE,
            "messages in the work queue before killing a consumer",
            || async { w.cluster.messages(&w.queue).await.unwrap_or(0) > 0 },
        )
        .await;
        let applied = w.applied().await;
        e2e::kill_now(consumers.remove(0));
        wait_until(DEADLINE, "the other consumer to apply more", || async {
            w.applied().await > applied + 100
        })
        .await;
        consumers.push(w.consumer(i + 1));
        report.push(format!("consumer {i} SIGKILLed with {applied} applied"));
    }

    stop_producing.cancel();
    ids.extend(producer.await.unwrap());
    assert!(ids.len() >= 20_000, "only {} events", ids.len());
    wait_until(DEADLINE, "the outbox to empty", || async {
        w.db.count("outbox").await == 0
    })
    .await;
    relay_stop.cancel();
    relay_task.await.unwrap();
    let dups = w
        .judge(
            consumers,
            &ids,
            "three-node cluster, nodes and consumers killed",
        )
        .await;
    for line in &report {
        println!("{line}");
    }
    println!("wire duplicates over all faults: {dups}");
    w.cleanup().await;
}

/// (e) Retries pending in the retry path while the work queue is full
/// (max-length, reject-publish) and while its leader is SIGKILLed: every
/// retried event is applied, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_retries_survive_a_full_work_queue_and_a_leader_kill() {
    const DELAY: Duration = Duration::from_secs(8);
    let w = World::new("cl_retry", |t| t.max_length = Some(200)).await;
    let retried: Vec<String> = w.db.produce(500, 100, Duration::ZERO).await;
    // The consumer sends every event's first attempt to the retry queue.
    let mut c = Command::new(env!("CARGO_BIN_EXE_fault-consumer"));
    c.env("DATABASE_URL", database_url())
        .env("AMQP_URL", w.urls_from(1))
        .env("SCHEMA", &w.consumer_schema)
        .env("QUEUE", &w.queue)
        .env("RETRY_FIRST_MS", DELAY.as_millis().to_string())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut consumer = KillOnDrop(c.spawn().unwrap());
    let (_relay, relay_stop, relay_task) = w.relay().await;
    let retry_queue = format!("{}.retry", w.queue);
    wait_until(
        DEADLINE,
        "every event waiting in the retry queue",
        || async { w.depth_of(&retry_queue).await == 500 },
    )
    .await;
    // The first retry expires `DELAY` after it was queued, not earlier.
    let all_expired_by = tokio::time::Instant::now() + DELAY;
    assert_eq!(
        e2e::stop_child(&mut consumer, Signal::SIGTERM, DEADLINE).await,
        Some(0)
    );
    assert_eq!(
        w.depth().await,
        0,
        "every first attempt went to the retry queue"
    );
    // Fill the work queue to its bound, then kill its leader.
    let fillers = w.db.produce(200, 100, Duration::ZERO).await;
    wait_until(DEADLINE, "the work queue full", || async {
        w.depth().await >= 200
    })
    .await;
    assert!(
        w.depth_of(&retry_queue).await == 500 && tokio::time::Instant::now() < all_expired_by,
        "a retry expired before the work queue was full"
    );
    let leader = w.cluster.leader(&w.queue).await.unwrap().expect("a leader");
    w.cluster.kill(leader).await.unwrap();
    // Every retry's TTL (a clock) runs out while the leader is down and
    // the queue is full.
    tokio::time::sleep_until(all_expired_by + Duration::from_secs(1)).await;
    w.cluster.start(leader).await.unwrap();
    let consumers = vec![w.consumer(2)];
    let mut ids = retried;
    ids.extend(fillers);
    wait_until(DEADLINE, "the outbox to empty", || async {
        w.db.count("outbox").await == 0
    })
    .await;
    relay_stop.cancel();
    relay_task.await.unwrap();
    w.judge(
        consumers,
        &ids,
        &format!(
            "retries pending while the work queue was full and its leader (node {leader}) killed"
        ),
    )
    .await;
    w.cleanup().await;
}
