//! Liveness and readiness ([`Health`]), shared by the relay's stages and
//! its HTTP endpoints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::mutex::lock;
use outbox_core::amqp::Nodes;

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug)]
pub struct Health {
    /// Connected to a broker node ([`Health::set_broker`]).
    broker: AtomicBool,
    /// The last database operation succeeded ([`Health::set_database`]).
    database: AtomicBool,
    /// The broker's nodes, shared with the connections' seam
    /// ([`Broker`](crate::broker::Broker)): which one is in use.
    nodes: Arc<Nodes>,
    /// The relay's broker connections the broker blocks now (a resource
    /// alarm), and the broker's reason for the last block.
    blocked: Mutex<(usize, String)>,
}

impl Health {
    pub(crate) fn new(nodes: Arc<Nodes>) -> Self {
        Self {
            broker: AtomicBool::new(false),
            database: AtomicBool::new(false),
            nodes,
            blocked: Mutex::new((0, String::new())),
        }
    }

    /// `host:port` of the broker node the relay is connected to, or was
    /// last connected to.
    pub fn broker_node(&self) -> Option<String> {
        self.nodes.current()
    }

    /// Connected to the broker, which does not block publishing, and the
    /// last database operation succeeded (none stopped answering).
    pub fn is_ready(&self) -> bool {
        self.broker.load(Ordering::Relaxed)
            && self.database.load(Ordering::Relaxed)
            && self.broker_blocked().is_none()
    }

    /// The broker's reason (`"low on memory"`, `"low on disk"`) while it
    /// blocks publishing on one of the relay's connections (a resource
    /// alarm: publishing waits, no attempt is counted).
    pub fn broker_blocked(&self) -> Option<String> {
        let b = lock(&self.blocked);
        (b.0 > 0).then(|| b.1.clone())
    }

    /// Whether the last database operation succeeded.
    pub fn database_ok(&self) -> bool {
        self.database.load(Ordering::Relaxed)
    }

    /// Connected to a broker node now.
    pub fn broker_connected(&self) -> bool {
        self.broker.load(Ordering::Relaxed)
    }

    /// The supervisor's word on the broker session: connected or not.
    pub(crate) fn set_broker(&self, connected: bool) {
        self.broker.store(connected, Ordering::Relaxed);
    }

    /// Whether the last database operation succeeded (the workers' and
    /// the supervisor's word).
    pub(crate) fn set_database(&self, ok: bool) {
        self.database.store(ok, Ordering::Relaxed);
    }

    pub(crate) fn block(&self, who: &'static str, reason: String) {
        let mut b = lock(&self.blocked);
        b.0 += 1;
        tracing::warn!(connection = who, %reason, "the broker blocks publishing (a resource alarm): publishing paused, no attempt counted, until it lifts");
        b.1 = reason;
        metrics::gauge!("outbox_relay_broker_blocked").set(1.0);
    }

    /// The broker lifted its block of `who`'s connection (`None`: the
    /// connection is gone, with its block).
    pub(crate) fn unblock(&self, who: Option<&'static str>) {
        let mut b = lock(&self.blocked);
        b.0 = b.0.saturating_sub(1);
        if let Some(who) = who {
            tracing::info!(
                connection = who,
                "the broker lifted its block: publishing resumes"
            );
        }
        if b.0 == 0 {
            metrics::gauge!("outbox_relay_broker_blocked").set(0.0);
        }
    }
}
