//! The pipeline on a three-node RabbitMQ cluster (`make cluster`) with
//! quorum queues, while nodes fail. The relay and two consumer processes
//! are each connected to a different node and given every node's URL.
//! Every fault lands on work in flight (a relay batch holds outbox rows,
//! the work queue holds messages); the oracle is the fault suites' one
//! (`world/`), judged once everything is quiet: committed ids = applied
//! effects, none twice, every one on the wire, the outbox empty.
//! Duplicates on the wire and the time from each fault until publishing
//! resumed are printed.
//!
//! `make test` runs these (`cluster_` prefix) alone, after the rest: they
//! stop and start the cluster's nodes.

use std::time::{Duration, Instant};

use e2e::{KillOnDrop, TestDb, wait_until};
use nix::sys::signal::Signal;
use outbox_relay::Relay;
use tokio_util::sync::CancellationToken;

mod world;

use world::{Broker, Options, World};

const DEADLINE: Duration = Duration::from_secs(120);

/// One test's world on the cluster: its own schemas, exchange and queues
/// (quorum), the relay in-process (confirm and broker timeouts 5 s), the
/// consumers `fault-consumer` processes.
async fn world(prefix: &str, max_length: Option<u32>) -> World {
    let options = Options {
        broker: Broker::on_cluster(0),
        max_length,
        consumer_processes: true,
        relay_timeout: Duration::from_secs(5),
        deadline: DEADLINE,
        ..Options::default()
    };
    World::with(TestDb::producer(prefix).await, prefix, options).await
}

/// The relay, in-process, connected first to node 0.
async fn relay(w: &World) -> (Relay, world::Running<outbox_relay::Error>) {
    w.relay_handle(&format!("relay-{}", e2e::suffix()), w.urls_from(0))
        .await
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

/// What each fault did, printed as it happens (with the time since the
/// test began, so a test stopped by nextest's timeout shows where it was)
/// and again as a summary at the end.
struct Report {
    began: Instant,
    lines: Vec<String>,
}

impl Report {
    fn new() -> Self {
        Self {
            began: Instant::now(),
            lines: Vec::new(),
        }
    }

    /// A fault's outcome: printed now and in the summary.
    fn push(&mut self, line: String) {
        self.step(&line);
        self.lines.push(line);
    }

    /// A step reached: printed now only.
    fn step(&self, what: impl std::fmt::Display) {
        println!("[{:6.1} s] {what}", self.began.elapsed().as_secs_f64());
    }

    fn print(&self) {
        for line in &self.lines {
            println!("{line}");
        }
    }
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
    let w = world("cl_nodes", None).await;
    let mut ids = w.db.produce(10_000, 500, Duration::ZERO).await;
    let (relay, relay_running) = relay(&w).await;
    let mut consumers = vec![w.consumer_process_on(1), w.consumer_process_on(2)];
    let stop_producing = CancellationToken::new();
    // 50 events per transaction, 100 ms apart: a little under 500/s.
    let producer =
        w.db.produce_until(stop_producing.clone(), 50, Duration::from_millis(100));
    let mut report = Report::new();

    // (a) The node the relay is connected to.
    report.step("10,000 events committed, relay and consumers started");
    relay_in_flight(&w, "killing the relay's node").await;
    let node = node_index(&relay.health().broker_node().expect("connected"));
    let killed = Instant::now();
    w.cluster().kill(node).await.unwrap();
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
        outbox_relay_ops::admin::status(&w.db.pool, &schema)
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
    w.cluster().start(node).await.unwrap();
    report.step(format!("node {node} running again"));

    // (b) The node leading the work queue.
    relay_in_flight(&w, "killing the queue's leader").await;
    let leader = w.queue_leader().await;
    let before = relay.published();
    w.cluster().kill(leader).await.unwrap();
    let t = publishing_resumed(&relay, before, Instant::now(), "the leader was killed").await;
    report.push(format!(
        "work queue's leader {leader} SIGKILLed: publishing resumed after {:.2} s",
        t.as_secs_f64()
    ));
    w.cluster().start(leader).await.unwrap();
    report.step(format!("node {leader} running again"));

    // (c) Every node restarted, one after another.
    for n in 0..3 {
        relay_in_flight(&w, "a rolling restart").await;
        let before = relay.published();
        let since = Instant::now();
        w.cluster().stop(n).await.unwrap();
        report.step(format!("node {n} stopped"));
        let t = publishing_resumed(&relay, before, since, "a node stopped").await;
        w.cluster().start(n).await.unwrap();
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
            || async { w.cluster().messages(&w.broker.queue).await.unwrap_or(0) > 0 },
        )
        .await;
        let applied = w.effects().await.1;
        e2e::kill_now(consumers.remove(0));
        wait_until(DEADLINE, "the other consumer to apply more", || async {
            w.effects().await.1 > applied + 100
        })
        .await;
        consumers.push(w.consumer_process_on(i + 1));
        report.push(format!("consumer {i} SIGKILLed with {applied} applied"));
    }

    stop_producing.cancel();
    ids.extend(producer.await.unwrap());
    report.step(format!(
        "{} events committed; waiting for the outbox to empty",
        ids.len()
    ));
    assert!(ids.len() >= 20_000, "only {} events", ids.len());
    wait_until(DEADLINE, "the outbox to empty", || async {
        w.db.count("outbox").await == 0
    })
    .await;
    relay_running.stop().await;
    report.step("the outbox empty; judging");
    let dups = w
        .judge(
            consumers,
            &ids,
            "three-node cluster, nodes and consumers killed",
        )
        .await
        .wire_duplicates;
    report.print();
    println!("wire duplicates over all faults: {dups}");
    w.cleanup().await;
}

/// (e) Retries pending in the retry path while the work queue is full
/// (max-length, reject-publish) and while its leader is SIGKILLed: every
/// retried event is applied, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_retries_survive_a_full_work_queue_and_a_leader_kill() {
    const DELAY: Duration = Duration::from_secs(8);
    let w = world("cl_retry", Some(200)).await;
    let retried: Vec<String> = w.db.produce(500, 100, Duration::ZERO).await;
    // The consumer sends every event's first attempt to the retry queue.
    let mut c = w.consumer_command(&w.urls_from(1));
    c.env("RETRY_FIRST_MS", DELAY.as_millis().to_string());
    let mut consumer = KillOnDrop(c.spawn().unwrap());
    let (_relay, relay_running) = relay(&w).await;
    let retry_queue = format!("{}.retry", w.broker.queue);
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
    let leader = w.queue_leader().await;
    w.cluster().kill(leader).await.unwrap();
    // Every retry's TTL (a clock) runs out while the leader is down and
    // the queue is full.
    tokio::time::sleep_until(all_expired_by + Duration::from_secs(1)).await;
    w.cluster().start(leader).await.unwrap();
    let consumers = vec![w.consumer_process_on(2)];
    let mut ids = retried;
    ids.extend(fillers);
    wait_until(DEADLINE, "the outbox to empty", || async {
        w.db.count("outbox").await == 0
    })
    .await;
    relay_running.stop().await;
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
