//! Where a world's exchange and queues live: the test broker, or the local
//! three-node cluster.

use std::time::Duration;

use e2e::cluster::Cluster;
use e2e::{TestBroker, amqp_url, suffix};
use lapin::types::{AMQPValue, FieldTable};
use outbox_consumer::{TopologyConfig, declare_topology};

/// Where a world's exchange and queues live.
pub(crate) enum Broker {
    /// The test broker (`AMQP_URL`); classic queues.
    Single,
    /// The local three-node cluster (`make cluster`); quorum queues, and
    /// every relay, consumer and wire counter given all three URLs,
    /// starting with node `first`.
    Cluster { cluster: Cluster, first: usize },
}

impl Broker {
    /// The local cluster, clients starting with node `first`.
    pub(crate) fn on_cluster(first: usize) -> Self {
        Broker::Cluster {
            cluster: Cluster::local(),
            first,
        }
    }

    /// The URLs the world's clients take, comma-separated.
    pub(crate) fn urls(&self) -> String {
        match self {
            Broker::Single => amqp_url(),
            Broker::Cluster { cluster, first } => cluster.url_list(*first),
        }
    }

    /// The URLs starting with node `first` (the test broker's URL on one
    /// node).
    pub(crate) fn urls_from(&self, first: usize) -> String {
        match self {
            Broker::Single => amqp_url(),
            Broker::Cluster { cluster, .. } => cluster.url_list(first),
        }
    }

    pub(crate) async fn connect(&self) -> lapin::Connection {
        match self {
            Broker::Single => e2e::connect().await,
            Broker::Cluster { cluster, .. } => cluster.connect().await.expect("a cluster node"),
        }
    }

    /// A connection to any node that answers, or why none did.
    pub(crate) async fn try_connect(&self) -> anyhow::Result<lapin::Connection> {
        e2e::connect_any(&self.urls_from(0)).await
    }

    pub(crate) fn cluster(&self) -> Option<&Cluster> {
        match self {
            Broker::Single => None,
            Broker::Cluster { cluster, .. } => Some(cluster),
        }
    }

    /// The exchange and the consumer's queue: on the cluster, the quorum
    /// topology consumers are told to declare (delivery limit, confirmed
    /// dead-lettering to `<queue>.dlq`, the retry queue), with
    /// `max_length` if given.
    pub(crate) async fn declare(&self, prefix: &str, max_length: Option<u32>) -> TestBroker {
        let Some(cluster) = self.cluster() else {
            assert!(max_length.is_none(), "a bounded queue is a cluster world's");
            return TestBroker::new(prefix, FieldTable::default()).await;
        };
        cluster.ensure_started().await.expect("make cluster");
        let s = suffix();
        let b = TestBroker {
            exchange: format!("test.{prefix}.{s}"),
            queue: format!("test.{prefix}.{s}.q"),
        };
        let conn = self.connect().await;
        let mut t = TopologyConfig::new(&b.queue, &b.exchange, "#");
        t.max_length = max_length;
        declare_topology(&conn, &t).await.unwrap();
        let _ = conn.close(200, "ok".into()).await;
        b
    }

    /// Arguments of a wire-counting queue.
    pub(crate) fn tap_args(&self) -> FieldTable {
        let mut args = FieldTable::default();
        if self.cluster().is_some() {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args
    }

    /// Messages of `queues` a passive declare does not count, with those it
    /// does: on one node, the broker's count of each (ready and
    /// unacknowledged: a consumer's window in hand); on the cluster, any a
    /// quorum queue holds (unacknowledged, or waiting to be dead-lettered
    /// at-least-once, such as an expired retry the work queue has not
    /// confirmed yet). `u64::MAX / 4` when the broker cannot say.
    pub(crate) async fn uncounted(&self, queues: &[String]) -> u64 {
        let Some(cluster) = self.cluster() else {
            return on_one_node(queues).await;
        };
        cluster.messages_in(queues).await.unwrap_or(u64::MAX / 4)
    }

    /// Deletes `queues` and `exchanges`, then the consumer's queue and the
    /// world's exchange.
    pub(crate) async fn cleanup(
        &self,
        broker: TestBroker,
        queues: &[String],
        exchanges: &[String],
    ) {
        if let Ok(conn) = self.try_connect().await {
            if let Ok(ch) = conn.create_channel().await {
                let on_cluster = self.cluster().map(|_| &broker.queue);
                for q in queues.iter().chain(on_cluster) {
                    let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
                }
                let world_exchange = self.cluster().map(|_| &broker.exchange);
                for x in exchanges.iter().chain(world_exchange) {
                    let _ = ch
                        .exchange_delete(x.as_str().into(), Default::default())
                        .await;
                }
            }
            let _ = conn.close(200, "ok".into()).await;
        }
        if self.cluster().is_none() {
            // The test broker's own clean-up.
            broker.cleanup().await;
        }
    }
}

/// `rabbitmqctl list_queues` on the test broker: the messages of `queues`,
/// ready and unacknowledged (a queue not listed holds none). One VM boot a
/// look (about 0.6 s of CPU), bounded by 20 s.
async fn on_one_node(queues: &[String]) -> u64 {
    let list = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(Duration::from_secs(20), list).await {
        Ok(Ok(out)) if out.status.success() => out,
        _ => return u64::MAX / 4,
    };
    let listed = String::from_utf8_lossy(&out.stdout);
    let mut n = 0;
    for line in listed.lines() {
        let mut cols = line.split('\t');
        let (Some(name), Some(count)) = (cols.next(), cols.next()) else {
            continue;
        };
        if queues.iter().any(|q| q == name) {
            n += count.trim().parse::<u64>().unwrap_or(u64::MAX / 4);
        }
    }
    n
}
