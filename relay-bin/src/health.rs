//! Liveness and readiness ([`Health`]), shared by the relay's stages and
//! its HTTP endpoints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use outbox_core::amqp::Nodes;

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug)]
pub struct Health {
    pub(crate) broker: AtomicBool,
    pub(crate) database: AtomicBool,
    /// The broker's nodes, shared with the connections' seam
    /// ([`Broker`](crate::broker::Broker)): which one is in use.
    nodes: Arc<Nodes>,
}

impl Health {
    pub(crate) fn new(nodes: Arc<Nodes>) -> Self {
        Self {
            broker: AtomicBool::new(false),
            database: AtomicBool::new(false),
            nodes,
        }
    }

    /// `host:port` of the broker node the relay is connected to, or was
    /// last connected to.
    pub fn broker_node(&self) -> Option<String> {
        self.nodes.current()
    }

    /// Connected to the broker and the last database operation succeeded.
    pub fn is_ready(&self) -> bool {
        self.broker.load(Ordering::Relaxed) && self.database.load(Ordering::Relaxed)
    }
}

/// A mutex's guard, whether or not a panic poisoned it (the sets it guards
/// stay consistent at every await point).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
