//! The relay's broker seam: connections with failover between the nodes
//! of `amqp_url` (`outbox_core::amqp::Nodes`, the consumer's too), shared
//! by the table's supervisor and the log's reader. A new connection starts
//! with the node in use while it works, and after the node whose session
//! failed once one did.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use tokio_util::sync::CancellationToken;

use crate::config::RelayConfig;
use crate::error::Result;
use outbox_core::amqp::{BlockWatch, Flow, Link, Nodes, bounded};

use crate::health::Health;

/// The broker's nodes (which one the next connection tries first, which
/// one is in use) and what each connection declares.
pub(crate) struct Broker {
    /// Shared with [`Health`](crate::Health), which shows the node in use.
    nodes: Arc<Nodes>,
    timeout: Duration,
    /// The exchange to declare on each connection, and its kind.
    declare: Option<(String, String)>,
    /// Shows the broker's blocks of the relay's connections.
    health: Arc<Health>,
    /// `outbox-relay <name>`: which relay a connection is, in the
    /// broker's connection list.
    connection_name: String,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// The nodes of `config.amqp_url`, for [`new`](Self::new) and
    /// [`Health`](crate::Health).
    pub(crate) fn nodes(config: &RelayConfig) -> Arc<Nodes> {
        Arc::new(Nodes::new(
            config.amqp_urls(),
            config.broker_timeout,
            "outbox_relay_broker_connected",
            vec![],
        ))
    }

    pub(crate) fn new(config: &RelayConfig, nodes: Arc<Nodes>, health: Arc<Health>) -> Self {
        Self {
            nodes,
            health,
            connection_name: format!("outbox-relay {}", config.name),
            timeout: config.broker_timeout,
            declare: config
                .declare_exchange
                .clone()
                .map(|kind| (config.default_exchange.clone(), kind)),
        }
    }

    /// Connects to the first node that answers (starting with the one in
    /// use, or after the one whose session failed) and declares the
    /// default exchange if configured. The session watches the broker's
    /// blocks of its connection ([`BlockWatch`]) for `who` (`"table
    /// workers"`, `"log reader"`).
    pub(crate) async fn connect(&self, who: &'static str) -> Result<BrokerSession> {
        let props = ConnectionProperties::default()
            .with_connection_name(self.connection_name.as_str().into());
        let (conn, link, node) = self.nodes.connect(props).await?;
        let broker = self.nodes.current().unwrap_or_default();
        tracing::info!(broker = %broker, "connected to the broker");
        let health = self.health.clone();
        let session = BrokerSession {
            watch: BlockWatch::new(&conn, move |flow| match flow {
                Flow::Blocked(reason) => health.block(who, reason),
                Flow::Unblocked => health.unblock(Some(who)),
                Flow::Gone => health.unblock(None),
            }),
            conn: Arc::new(conn),
            link,
            node,
        };
        if let Some((name, kind)) = &self.declare
            && let Err(e) = declare_exchange(&session.conn, name, kind, self.timeout).await
        {
            self.leave(node);
            session.close(self.timeout).await;
            return Err(e);
        }
        Ok(session)
    }

    /// A session on node `i` failed: the next connection starts with the
    /// node after it (unless another session, the WAL reader's or one
    /// made since, moved on already).
    pub(crate) fn leave(&self, i: usize) {
        self.nodes.leave(i);
    }

    /// The connection to the node in use is gone: its gauge drops to 0.
    pub(crate) fn gone(&self) {
        self.nodes.gone();
    }

    /// Connects (with failover, as the workers do), opens a confirm-mode
    /// channel and closes both again: fails fast, naming the node, when
    /// no node takes a connection or opens the channel.
    pub(crate) async fn check(&self) -> Result<()> {
        let session = self.connect("start-up check").await?;
        let publisher = crate::publish::Publisher::open(&session.conn, self.timeout).await;
        if let Ok(p) = &publisher {
            p.close().await;
        }
        session.close(self.timeout).await;
        publisher.map(drop)
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

/// One broker connection of the relay's: the connection, the [`Link`]
/// under it, its node's index (for [`Broker::leave`]) and the watch on the
/// broker's blocks of it.
pub(crate) struct BrokerSession {
    pub(crate) conn: Arc<Connection>,
    link: Link,
    pub(crate) node: usize,
    watch: BlockWatch,
}

impl BrokerSession {
    /// Closes the connection, for sure: politely within `timeout`, or cut
    /// ([`Link::close`]; a connection the broker blocks cannot send its
    /// own close). Gone when this returns.
    pub(crate) async fn close(self, timeout: Duration) {
        drop(self.watch);
        self.link.close(&self.conn, timeout).await;
    }

    /// Cuts the connection now ([`Link::abort`]).
    pub(crate) fn abort(self) {
        drop(self.watch);
        self.link.abort();
    }
}

/// Whether the broker blocks `conn`'s publishing now.
pub(crate) fn blocked_now(conn: &Connection) -> bool {
    outbox_core::amqp::is_blocked(conn)
}

/// Waits while the broker blocks `conn`; false when `stop` came first.
pub(crate) async fn unblocked(conn: &Connection, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = outbox_core::amqp::while_blocked(conn) => !stop.is_cancelled(),
    }
}
