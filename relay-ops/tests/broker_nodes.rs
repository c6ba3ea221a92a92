//! Which broker node the relay uses: the first of its list that answers,
//! kept while it works (the start-up check included), left for the next
//! one once a session on it failed. Nodes are told apart by their
//! `host:port`: besides the broker's own address, fault proxies in front
//! of the same broker serve as more working nodes, and port 1 as a dead
//! one.

use std::process::Command;
use std::time::Duration;

use e2e::{Collector, KillOnDrop, Proxy, TestBroker, TestDb, amqp_url, database_url, wait_until};
use lapin::types::FieldTable;
use nix::sys::signal::Signal;
use outbox_relay::{Relay, RelayConfig};
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(60);

/// The broker's own address as a URL of another node.
fn node_url(port: u16) -> String {
    let mut u = url::Url::parse(&amqp_url()).expect("TEST_AMQP_URL");
    u.set_host(Some("127.0.0.1")).expect("host");
    u.set_port(Some(port)).expect("port");
    u.to_string()
}

/// `host:port` of `url`, as the relay names its node.
fn host_port(url: &str) -> String {
    let u = url::Url::parse(url).expect("url");
    format!(
        "{}:{}",
        u.host_str().expect("host"),
        u.port().unwrap_or(5672)
    )
}

/// A working node on a port of its own: a proxy to the test broker.
async fn proxy_node() -> (Proxy, String) {
    let direct = url::Url::parse(&amqp_url()).expect("TEST_AMQP_URL");
    let upstream = format!(
        "{}:{}",
        direct.host_str().expect("host"),
        direct.port().unwrap_or(5672)
    );
    let proxy = Proxy::start(upstream.parse().expect("the broker's address")).await;
    let url = proxy.url(&amqp_url());
    (proxy, url)
}

/// The relay binary started as a deployment starts it (its start-up
/// broker check first), logging at info to `log`.
fn relay_cmd(db: &TestDb, broker: &TestBroker, urls: &[String], log: &std::path::Path) -> Command {
    let mut c = e2e::relay_command(env!("CARGO_BIN_EXE_outbox-relay"), db, broker);
    c.env("AMQP_URL", urls.join(","))
        .env("OUTBOX_BROKER_TIMEOUT", "2s")
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(log).expect("log file"));
    c
}

/// An in-process relay's settings: one worker on `nodes` (URLs), polling
/// every 100 ms, reconnecting after `reconnect` (jittered to at least half).
fn two_node_config(
    db: &TestDb,
    broker: &TestBroker,
    nodes: &[&str],
    reconnect: (Duration, Duration),
) -> RelayConfig {
    let mut c = RelayConfig::default();
    c.amqp_url = nodes.join(",").into();
    c.schema = db.schema.clone();
    c.default_exchange = broker.exchange.clone();
    c.declare_exchange = None;
    c.workers = 1;
    c.poll_interval = Duration::from_millis(100);
    (c.reconnect_min, c.reconnect_max) = reconnect;
    c
}

/// The `broker` column of the relay's `outbox_relays` row, once written.
async fn recorded_broker(db: &TestDb) -> Option<String> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT broker FROM \"{}\".outbox_relays WHERE broker IS NOT NULL",
        db.schema
    )))
    .fetch_optional(&db.pool)
    .await
    .expect("outbox_relays")
}

/// The nodes named by the log's `connected to the broker` lines, in order.
fn connections_logged(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("connected to the broker"))
        .map(|l| {
            let at = l.find("broker=").expect("a broker field") + "broker=".len();
            l[at..].split_whitespace().next().unwrap_or("").to_owned()
        })
        .collect()
}

/// Defect: the start-up check recorded its node as used, so the supervisor
/// started with the next one: a relay whose first node was healthy moved
/// to the second 8 ms after start, and services meant to spread over the
/// nodes (lists starting at different nodes) did not. Now the node that
/// answered the check is the one the relay publishes through: the first
/// URL when it is up, the second when the first is down (not the third).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_stays_on_the_node_that_answered_its_start_up_check() {
    let db = TestDb::producer("nodes_stay").await;
    let broker = TestBroker::new("nodes_stay", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let (_proxy, other) = proxy_node().await;
    let (direct, dead) = (node_url(5672), node_url(1));
    let cases = [
        (
            "first node up",
            vec![direct.clone(), other.clone(), dead.clone()],
            0,
        ),
        (
            "first node down",
            vec![dead.clone(), direct.clone(), other.clone()],
            1,
        ),
    ];
    for (case, urls, expected) in cases {
        let log = std::env::temp_dir().join(format!("{}-{}.log", db.schema, expected));
        let ids = db.produce(200, 50, Duration::ZERO).await;
        let mut child = KillOnDrop(relay_cmd(&db, &broker, &urls, &log).spawn().unwrap());
        wait_until(DEADLINE, "the events published", || async {
            ids.iter().all(|id| collector.has(id))
        })
        .await;
        wait_until(DEADLINE, "the broker node recorded", || async {
            recorded_broker(&db).await.is_some()
        })
        .await;
        let recorded = recorded_broker(&db).await.unwrap();
        assert_eq!(
            e2e::stop_child(&mut child, Signal::SIGTERM, DEADLINE).await,
            Some(0),
            "{case}: a clean stop"
        );
        let text = std::fs::read_to_string(&log).expect("the relay's log");
        let _ = std::fs::remove_file(&log);
        let want = host_port(&urls[expected]);
        assert_eq!(
            recorded, want,
            "{case}: outbox_relays.broker names node {expected}"
        );
        let logged = connections_logged(&text);
        assert!(
            logged.len() >= 2,
            "{case}: the start-up check and the session connected:\n{text}"
        );
        assert!(
            logged.iter().all(|n| *n == want),
            "{case}: every connection went to node {expected} ({want}), got {logged:?}"
        );
    }
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

/// The other half of the rule: a node whose session failed is left. Two
/// working nodes (proxies); the first one's connections are reset and it
/// takes new ones again before the relay reconnects: the relay reconnects
/// to the second node, and publishes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failed_session_the_relay_moves_to_the_next_node() {
    let db = TestDb::producer("nodes_leave").await;
    let broker = TestBroker::new("nodes_leave", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let (first, first_url) = proxy_node().await;
    let (_second, second_url) = proxy_node().await;
    // Time to let the first node take connections again before the
    // reconnect.
    let c = two_node_config(
        &db,
        &broker,
        &[&first_url, &second_url],
        (Duration::from_secs(2), Duration::from_secs(2)),
    );
    let relay = Relay::new(db.pool.clone(), c).await.unwrap();
    // As the binary does at start.
    relay
        .connect()
        .await
        .unwrap()
        .close(Duration::from_secs(5))
        .await;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (r, s) = (relay.clone(), stop.clone());
        async move { r.run(s).await }
    });
    let ids = db.produce(20, 20, Duration::ZERO).await;
    wait_until(DEADLINE, "the first events published", || async {
        ids.iter().all(|id| collector.has(id))
    })
    .await;
    assert_eq!(relay.health().broker_node(), Some(host_port(&first_url)));

    first.set(e2e::Mode::Reset);
    let ids = db.produce(20, 20, Duration::ZERO).await;
    relay.wake();
    wait_until(DEADLINE, "the session on the first node to end", || async {
        !relay.health().is_ready()
    })
    .await;
    first.set(e2e::Mode::Pass);
    wait_until(DEADLINE, "the events published after the reset", || async {
        ids.iter().all(|id| collector.has(id))
    })
    .await;
    assert_eq!(
        relay.health().broker_node(),
        Some(host_port(&second_url)),
        "the failed node is not the first one tried again"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

/// Defect (the cluster matrix, a node stopped while the relay idled): a
/// session with nothing to publish never noticed that its node closed the
/// connection, so the relay stayed "connected" to a stopped node (ready,
/// its node recorded) until the next event. Now an idle table worker and an
/// idle log reader notice at their next poll or keep-alive: every session
/// moves to the next node with nothing produced meanwhile.
async fn an_idle_relay_leaves_a_node_that_closed_its_connections(capture: outbox::Capture) {
    let wal = capture == outbox::Capture::Wal;
    let prefix = if wal { "nodes_idle_w" } else { "nodes_idle_t" };
    let db = if wal {
        TestDb::producer_wal(prefix).await
    } else {
        TestDb::producer(prefix).await
    };
    let broker = TestBroker::new(prefix, FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let (first, first_url) = proxy_node().await;
    let (second, second_url) = proxy_node().await;
    let mut c = two_node_config(
        &db,
        &broker,
        &[&first_url, &second_url],
        (Duration::from_millis(50), Duration::from_millis(200)),
    );
    if wal {
        let mut w = outbox_relay::WalCapture::new(database_url());
        w.standby_poll = Duration::from_millis(200);
        c.wal = Some(w);
    }
    let relay = Relay::new(db.pool.clone(), c).await.unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (r, s) = (relay.clone(), stop.clone());
        async move { r.run(s).await }
    });
    let ids = db.produce(20, 10, Duration::ZERO).await;
    wait_until(DEADLINE, "the first events published", || async {
        ids.iter().all(|id| collector.has(id))
    })
    .await;
    assert_eq!(relay.health().broker_node(), Some(host_port(&first_url)));
    assert_eq!(
        second.connections(),
        0,
        "nothing went to the second node yet"
    );

    // Nothing more is produced: only noticing the closed connection moves
    // the sessions (the table's, and the log reader's in WAL capture).
    first.set(e2e::Mode::Reset);
    let sessions = if wal { 2 } else { 1 };
    wait_until(
        DEADLINE,
        &format!("{sessions} idle session(s) to reconnect on the second node"),
        || async { second.connections() >= sessions },
    )
    .await;
    wait_until(DEADLINE, "the relay ready on the second node", || async {
        relay.health().is_ready() && relay.health().broker_node() == Some(host_port(&second_url))
    })
    .await;
    first.set(e2e::Mode::Pass);
    let ids = db.produce(20, 10, Duration::ZERO).await;
    wait_until(
        DEADLINE,
        "the events published on the second node",
        || async { ids.iter().all(|id| collector.has(id)) },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_table_relay_leaves_a_node_that_closed_its_connections() {
    an_idle_relay_leaves_a_node_that_closed_its_connections(outbox::Capture::Table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_wal_relay_leaves_a_node_that_closed_its_connections() {
    an_idle_relay_leaves_a_node_that_closed_its_connections(outbox::Capture::Wal).await;
}
