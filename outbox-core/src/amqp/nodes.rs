//! A broker's nodes, as the relay, its WAL reader and the consumer connect
//! to them: failover in the list's order, which node the next connection
//! tries first, and which node is in use (the `*_broker_connected` gauge).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use super::{BrokerError, Link, connect_any};
use crate::urls::host_port;

/// The nodes of a broker URL list (never printed: they may hold
/// passwords), which one the next connection tries first, and which one is
/// in use, shown by a gauge set to 1 for the node in use and 0 for the one
/// left.
///
/// A new connection starts with the node in use, until a session on it
/// fails ([`leave`](Self::leave)): then with the node after it. A session
/// that ended cleanly (the relay's start-up check) is no reason to leave a
/// node, and services whose lists start at different nodes stay spread.
pub struct Nodes {
    urls: Vec<String>,
    timeout: Duration,
    /// Index of the URL the next connection tries first.
    next: AtomicUsize,
    /// `host:port` of the node in use (or last used).
    current: Mutex<Option<String>>,
    /// The gauge's name and its labels besides `node`.
    gauge: &'static str,
    labels: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nodes")
            .field("nodes", &self.urls.len())
            .finish_non_exhaustive()
    }
}

impl Nodes {
    /// The nodes of `urls` (tried in this order from the first), each
    /// connection bounded by `timeout`; `gauge` (with `labels` besides
    /// `node`) shows the node in use.
    pub fn new(
        urls: Vec<String>,
        timeout: Duration,
        gauge: &'static str,
        labels: Vec<(&'static str, String)>,
    ) -> Self {
        Self {
            urls,
            timeout,
            next: AtomicUsize::new(0),
            current: Mutex::new(None),
            gauge,
            labels,
        }
    }

    /// Connects to the first node that answers, starting with the one in
    /// use, or after the one whose session failed ([`connect_any`]), and
    /// records it as the node in use.
    /// Returns the connection, the [`Link`] that can cut it and the node's
    /// index, for [`leave`](Self::leave).
    pub async fn connect(
        &self,
        props: ConnectionProperties,
    ) -> Result<(Connection, Link, usize), BrokerError> {
        let start = self.next.load(Ordering::Relaxed);
        let (conn, link, i) = connect_any(&self.urls, start, self.timeout, props).await?;
        self.next.store(i, Ordering::Relaxed);
        let node = host_port(&self.urls[i]);
        let previous = self.lock().replace(node.clone());
        if let Some(p) = previous.filter(|p| *p != node) {
            self.set(p, 0.0);
        }
        self.set(node, 1.0);
        Ok((conn, link, i))
    }

    /// A session on node `i` failed: the next connection starts with the
    /// node after it, unless another session moved on already (a
    /// connection made since): then that choice stands.
    pub fn leave(&self, i: usize) {
        let n = self.urls.len().max(1);
        let _ = self
            .next
            .compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The connection to the node in use is gone: its gauge drops to 0
    /// (the node stays the one last used).
    pub fn gone(&self) {
        if let Some(node) = self.current() {
            self.set(node, 0.0);
        }
    }

    /// `host:port` of the node in use, or last used.
    pub fn current(&self) -> Option<String> {
        self.lock().clone()
    }

    fn set(&self, node: String, value: f64) {
        let mut labels: Vec<metrics::Label> = self
            .labels
            .iter()
            .map(|(k, v)| metrics::Label::new(*k, v.clone()))
            .collect();
        labels.push(metrics::Label::new("node", node));
        metrics::gauge!(self.gauge, labels).set(value);
    }

    /// The node in use, whether or not a panic poisoned the lock (it only
    /// ever holds a whole value).
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> Nodes {
        let urls = (1..=3)
            .map(|p| format!("amqp://guest:guest@127.0.0.1:{p}/%2f"))
            .collect();
        Nodes::new(urls, Duration::from_millis(50), "g", vec![])
    }

    #[test]
    fn leaving_a_node_moves_on_only_from_the_node_left() {
        let n = nodes();
        n.leave(0);
        assert_eq!(n.next.load(Ordering::Relaxed), 1);
        // A stale session's failure on node 0 does not move past node 1.
        n.leave(0);
        assert_eq!(n.next.load(Ordering::Relaxed), 1);
        n.leave(2);
        assert_eq!(n.next.load(Ordering::Relaxed), 1);
        n.leave(1);
        n.leave(2);
        assert_eq!(n.next.load(Ordering::Relaxed), 0);
    }
}
