//! The relay's broker seam: connections with failover between the nodes
//! of `amqp_url`, shared by the table's supervisor and the log's reader.
//! A new connection starts with the node in use while it works, and after
//! the node whose session failed once one did.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

use crate::config::RelayConfig;
use crate::error::Result;
use crate::health::{Health, lock};
use outbox_core::amqp::bounded;

/// The broker's nodes and which one the next connection tries first.
pub(crate) struct Broker {
    /// The URLs of `amqp_url`, in the order tried (never printed).
    urls: Vec<String>,
    timeout: Duration,
    /// The exchange to declare on each connection, and its kind.
    declare: Option<(String, String)>,
    /// Index of the URL the next connection tries first.
    next: AtomicUsize,
    /// Where the node in use is shown.
    health: Arc<Health>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("nodes", &self.urls.len())
            .finish_non_exhaustive()
    }
}

impl Broker {
    pub(crate) fn new(config: &RelayConfig, health: Arc<Health>) -> Self {
        Self {
            urls: config.amqp_urls(),
            timeout: config.broker_timeout,
            declare: config
                .declare_exchange
                .clone()
                .map(|kind| (config.default_exchange.clone(), kind)),
            next: AtomicUsize::new(0),
            health,
        }
    }

    /// Connects to the first node that answers (starting with the one in
    /// use, or after the one whose session failed) and declares the
    /// default exchange if configured. Returns the connection and the
    /// index of its node, for [`leave`](Self::leave).
    pub(crate) async fn connect(&self) -> Result<(Arc<Connection>, usize)> {
        let props = ConnectionProperties::default().with_connection_name("outbox-relay".into());
        let start = self.next.load(Ordering::Relaxed);
        let (conn, i) =
            outbox_core::amqp::connect_any(&self.urls, start, self.timeout, props).await?;
        self.using(i);
        let conn = Arc::new(conn);
        if let Some((name, kind)) = &self.declare
            && let Err(e) = declare_exchange(&conn, name, kind, self.timeout).await
        {
            self.leave(i);
            return Err(e);
        }
        Ok((conn, i))
    }

    /// Records (health, metrics, log) that the relay is connected to node
    /// `i`; the next connection starts with it again (a session that ended
    /// cleanly, such as the start-up check, is no reason to leave a node:
    /// services whose lists start at different nodes stay spread).
    fn using(&self, i: usize) {
        let node = outbox::redact::host_port(&self.urls[i]);
        let previous = lock(&self.health.node).replace(node.clone());
        if let Some(p) = previous.filter(|p| *p != node) {
            metrics::gauge!("outbox_relay_broker_connected", "node" => p).set(0.0);
        }
        metrics::gauge!("outbox_relay_broker_connected", "node" => node.clone()).set(1.0);
        self.next.store(i, Ordering::Relaxed);
        tracing::info!(broker = %node, "connected to the broker");
    }

    /// A session on node `i` failed: the next connection starts with the
    /// node after it, so a failing node is not the first one tried again.
    /// Unless another session already moved on (the WAL reader's, or a
    /// connection made since): then that choice stands.
    pub(crate) fn leave(&self, i: usize) {
        let n = self.urls.len().max(1);
        let _ = self
            .next
            .compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The connection to the node in use is gone: its gauge drops to 0.
    pub(crate) fn gone(&self) {
        if let Some(node) = lock(&self.health.node).clone() {
            metrics::gauge!("outbox_relay_broker_connected", "node" => node).set(0.0);
        }
    }
}

/// Declares `name` durable with `kind`, idempotently.
async fn declare_exchange(
    conn: &Connection,
    name: &str,
    kind: &str,
    timeout: Duration,
) -> Result<()> {
    let ch = bounded("channel open", timeout, conn.create_channel()).await?;
    let kind = match kind {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        _ => ExchangeKind::Topic,
    };
    let opts = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(
        "exchange.declare",
        timeout,
        ch.exchange_declare(name.into(), kind, opts, FieldTable::default()),
    )
    .await?;
    let _ = bounded("channel close", timeout, ch.close(200, "OK".into())).await;
    Ok(())
}
