//! The local three-node RabbitMQ cluster of `make cluster`
//! (`scripts/cluster.sh`): `outbox-c1@localhost` to `outbox-c3@localhost`
//! on 127.0.0.1:5701-5703, beside the default broker. Node control shells
//! out to the script; every call is bounded by a deadline.
//!
//! Nodes are numbered from 0 like [`Cluster::urls`]: node `n` is
//! `outbox-c{n+1}@localhost`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::Command;

/// The nodes' Erlang names, in order.
const NODES: [&str; 3] = [
    "outbox-c1@localhost",
    "outbox-c2@localhost",
    "outbox-c3@localhost",
];
/// Their AMQP ports on 127.0.0.1.
const PORTS: [u16; 3] = [5701, 5702, 5703];
/// Bound on a script call that starts or stops nodes (it may also wait for
/// another process's call to finish: the script takes a lock).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on a script call that only asks.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The local cluster: its URLs and the script that controls its nodes.
#[derive(Debug, Clone)]
pub struct Cluster {
    urls: Vec<String>,
    script: PathBuf,
}

impl Cluster {
    /// The three local nodes; `CLUSTER_AMQP_URLS` (three comma-separated URLs) overrides their URLs.
    pub fn local() -> Self {
        Self {
            urls: urls_from(std::env::var("CLUSTER_AMQP_URLS").ok()),
            script: [
                env!("CARGO_MANIFEST_DIR"),
                "..",
                "..",
                "scripts",
                "cluster.sh",
            ]
            .iter()
            .collect(),
        }
    }

    /// The nodes' AMQP URLs, node 0 first.
    pub fn urls(&self) -> Vec<String> {
        self.urls.clone()
    }

    /// Node `n`'s AMQP URL (panics unless `n` < 3).
    pub fn url(&self, n: usize) -> String {
        self.urls[n].clone()
    }

    /// The nodes' URLs starting with node `first`, comma-separated: the
    /// list a relay or a consumer takes (`AMQP_URL`), tried in that order.
    pub fn url_list(&self, first: usize) -> String {
        let n = self.urls.len();
        (0..n)
            .map(|k| self.urls[(first + k) % n].as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node whose URL names `host_port` (`127.0.0.1:5701`, as a relay
    /// records the node it uses in `outbox_relays.broker`).
    pub fn node_at(&self, host_port: &str) -> Option<usize> {
        self.urls.iter().position(|u| {
            url::Url::parse(u).is_ok_and(|u| {
                u.host_str()
                    .zip(u.port())
                    .is_some_and(|(h, p)| format!("{h}:{p}") == host_port)
            })
        })
    }

    /// A connection to the first node that answers.
    pub async fn connect(&self) -> Result<lapin::Connection> {
        crate::connect_any(&self.url_list(0)).await
    }

    /// Node `n`'s Erlang node name, `outbox-c{n+1}@localhost` (panics unless `n` < 3).
    pub fn node_name(&self, n: usize) -> String {
        NODES[n].to_owned()
    }

    /// Starts whatever is down and forms the cluster (`cluster.sh start`); about 1 s when all runs.
    pub async fn ensure_started(&self) -> Result<()> {
        self.run(&["start"], CONTROL_TIMEOUT).await.map(drop)
    }

    /// SIGKILLs node `n`'s Erlang VM; returns once the process is gone and its AMQP port closed.
    pub async fn kill(&self, n: usize) -> Result<()> {
        self.run(&["kill", &self.arg(n)], CONTROL_TIMEOUT)
            .await
            .map(drop)
    }

    /// Stops node `n` gracefully; returns once the process is gone and its AMQP port closed.
    pub async fn stop(&self, n: usize) -> Result<()> {
        self.run(&["stop-node", &self.arg(n)], CONTROL_TIMEOUT)
            .await
            .map(drop)
    }

    /// Stops node `n` gracefully, like [`Cluster::stop`]; the node starts
    /// again when the guard is started or dropped, so a test that panics
    /// leaves all three nodes running.
    pub async fn stop_for_a_while(&self, n: usize) -> Result<StoppedNode> {
        // A stop that failed half-way still leaves the guard to start it.
        let guard = StoppedNode {
            cluster: self.clone(),
            n,
            stopped: true,
        };
        self.stop(n).await?;
        Ok(guard)
    }

    /// Starts node `n` again (it rejoins by itself); returns once it runs in the cluster.
    pub async fn start(&self, n: usize) -> Result<()> {
        self.run(&["start-node", &self.arg(n)], CONTROL_TIMEOUT)
            .await
            .map(drop)
    }

    /// The node leading quorum queue `queue` of vhost `/`; `None` without such a queue or while it has no leader.
    pub async fn leader(&self, queue: &str) -> Result<Option<usize>> {
        let out = self.output(&["leader", queue], QUERY_TIMEOUT).await?;
        match out.status.code() {
            Some(0) => {}
            Some(2) => return Ok(None),
            _ => bail!("cluster.sh leader {queue} failed: {}", text(&out)),
        }
        let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        match NODES.iter().position(|n| *n == name) {
            Some(n) => Ok(Some(n)),
            None => bail!("cluster.sh leader {queue}: unknown node {name:?}"),
        }
    }

    /// Every message of `queue` in vhost `/`: ready, unacknowledged, and
    /// (quorum) those waiting to be dead-lettered at-least-once, which an
    /// AMQP passive declare does not count.
    pub async fn messages(&self, queue: &str) -> Result<u64> {
        self.messages_in(&[queue]).await
    }

    /// [`Cluster::messages`] of every queue of `queues`, summed, from one
    /// listing: each look boots a VM for `rabbitmqctl` (about 0.6 s of
    /// CPU), so a wait polls it once a second at most
    /// ([`crate::wait_until_every`]). An error when a queue is missing.
    pub async fn messages_in(&self, queues: &[impl AsRef<str>]) -> Result<u64> {
        let mut args = vec!["messages"];
        args.extend(queues.iter().map(AsRef::as_ref));
        let out = self.output(&args, QUERY_TIMEOUT).await?;
        let named = args[1..].join(" ");
        if !out.status.success() {
            bail!("cluster.sh messages {named} failed: {}", text(&out));
        }
        let n = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        n.parse()
            .with_context(|| format!("cluster.sh messages {named}: not a count: {n:?}"))
    }

    /// Whether node `n` accepts connections on its AMQP port (opened last in a node's boot); 1 s at most.
    pub async fn is_up(&self, n: usize) -> bool {
        let url = url::Url::parse(&self.urls[n]).ok();
        let host = url
            .as_ref()
            .and_then(|u| u.host_str())
            .unwrap_or("127.0.0.1");
        let port = url.as_ref().and_then(|u| u.port()).unwrap_or(PORTS[n]);
        let connect = tokio::net::TcpStream::connect((host, port));
        matches!(
            tokio::time::timeout(Duration::from_secs(1), connect).await,
            Ok(Ok(_))
        )
    }

    /// The script's name for node `n` (1-based).
    fn arg(&self, n: usize) -> String {
        assert!(n < NODES.len(), "no node {n}: the cluster has nodes 0 to 2");
        (n + 1).to_string()
    }

    /// Runs the script; fails with what it printed unless it exits 0.
    async fn run(&self, args: &[&str], timeout: Duration) -> Result<String> {
        let out = self.output(args, timeout).await?;
        if !out.status.success() {
            bail!(
                "scripts/cluster.sh {} failed ({}): {}",
                args.join(" "),
                out.status,
                text(&out)
            );
        }
        Ok(text(&out))
    }

    /// Runs the script, killing it after `timeout`.
    async fn output(&self, args: &[&str], timeout: Duration) -> Result<std::process::Output> {
        let child = Command::new(&self.script)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        tokio::time::timeout(timeout, child)
            .await
            .with_context(|| {
                format!(
                    "scripts/cluster.sh {} took over {timeout:?}",
                    args.join(" ")
                )
            })?
            .with_context(|| format!("run {}", self.script.display()))
    }
}

/// A node stopped by [`Cluster::stop_for_a_while`], started again by
/// [`StoppedNode::start`] or, blocking, when dropped.
#[derive(Debug)]
pub struct StoppedNode {
    cluster: Cluster,
    n: usize,
    stopped: bool,
}

impl StoppedNode {
    /// The stopped node's number.
    pub fn node(&self) -> usize {
        self.n
    }

    /// Starts the node again; returns once it runs in the cluster.
    pub async fn start(mut self) -> Result<()> {
        self.stopped = false;
        self.cluster.start(self.n).await
    }
}

impl Drop for StoppedNode {
    fn drop(&mut self) {
        if !self.stopped {
            return;
        }
        // No runtime to await on while a test unwinds: the script runs to
        // its end here (it bounds its own waits).
        let ok = std::process::Command::new(&self.cluster.script)
            .args(["start-node", &self.cluster.arg(self.n)])
            .stdin(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "could not start cluster node {} again: run `make cluster`",
                self.n
            );
        }
    }
}

/// The URLs from `CLUSTER_AMQP_URLS`, or the local nodes' (guest/guest).
fn urls_from(var: Option<String>) -> Vec<String> {
    match var {
        Some(list) if !list.trim().is_empty() => {
            let urls: Vec<String> = list.split(',').map(|u| u.trim().to_owned()).collect();
            assert_eq!(
                urls.len(),
                NODES.len(),
                "CLUSTER_AMQP_URLS lists {} URLs, not one per node",
                urls.len()
            );
            urls
        }
        _ => PORTS
            .iter()
            .map(|p| format!("amqp://guest:guest@127.0.0.1:{p}/%2f"))
            .collect(),
    }
}

/// What a script call printed, stdout then stderr.
fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .trim()
    .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_default_to_the_local_nodes_and_can_be_overridden() {
        assert_eq!(
            urls_from(None),
            [
                "amqp://guest:guest@127.0.0.1:5701/%2f",
                "amqp://guest:guest@127.0.0.1:5702/%2f",
                "amqp://guest:guest@127.0.0.1:5703/%2f",
            ]
        );
        assert_eq!(
            urls_from(Some("amqp://a:1/%2f, amqp://b:2/%2f,amqp://c:3/%2f".into())),
            ["amqp://a:1/%2f", "amqp://b:2/%2f", "amqp://c:3/%2f"]
        );
        assert!(Cluster::local().script.ends_with("scripts/cluster.sh"));
    }

    #[test]
    fn url_lists_rotate_and_nodes_are_found_by_address() {
        let c = Cluster {
            urls: urls_from(None),
            script: PathBuf::new(),
        };
        assert_eq!(
            c.url_list(2),
            "amqp://guest:guest@127.0.0.1:5703/%2f,amqp://guest:guest@127.0.0.1:5701/%2f,\
             amqp://guest:guest@127.0.0.1:5702/%2f"
        );
        assert_eq!(c.node_at("127.0.0.1:5702"), Some(1));
        assert_eq!(c.node_at("127.0.0.1:5672"), None);
    }
}
