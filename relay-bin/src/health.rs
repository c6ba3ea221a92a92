//! Liveness and readiness ([`Health`]), shared by the relay's stages and
//! its HTTP endpoints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    pub(crate) broker: AtomicBool,
    pub(crate) database: AtomicBool,
    /// `host:port` of the broker node in use (or last used).
    pub(crate) node: Mutex<Option<String>>,
}

impl Health {
    /// `host:port` of the broker node the relay is connected to, or was
    /// last connected to.
    pub fn broker_node(&self) -> Option<String> {
        lock(&self.node).clone()
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
