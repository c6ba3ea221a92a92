//! One in-process gate per (scope, key) in use.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::time::Duration;

/// One in-process gate per (scope, key) in use: concurrent requests with
/// the same key wait here, holding no database connection, so a client
/// repeating one request cannot take the pool; only the request holding
/// the gate holds a connection (one per key per process).
#[derive(Debug, Clone, Default)]
pub(super) struct Gates {
    open: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    pub(super) waiting: Arc<AtomicUsize>,
}

/// A held gate; released (and forgotten when nobody else wants it) on drop.
pub(super) struct Gate {
    gates: Gates,
    key: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Gates {
    /// Waits up to `wait` for the gate of `key`; `None` past it.
    pub(super) async fn enter(&self, key: String, wait: Duration) -> Option<Gate> {
        let gate = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.entry(key.clone()).or_default().clone()
        };
        let guard = match gate.clone().try_lock_owned() {
            Ok(guard) => Some(guard),
            Err(_) if wait.is_zero() => None,
            Err(_) => {
                // Counted while waiting, even if the request is dropped
                // (the client went away) mid-wait.
                struct Waiting<'a>(&'a AtomicUsize);
                impl Drop for Waiting<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, AtomicOrdering::Relaxed);
                    }
                }
                self.waiting.fetch_add(1, AtomicOrdering::Relaxed);
                let _waiting = Waiting(&self.waiting);
                tokio::time::timeout(wait, gate.lock_owned()).await.ok()
            }
        };
        let gate = Gate {
            gates: self.clone(),
            key,
            guard,
        };
        gate.guard.is_some().then_some(gate)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut open = self.gates.open.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map holds it: nobody waits for this key any more.
        if open
            .get(&self.key)
            .is_some_and(|g| Arc::strong_count(g) == 1)
        {
            open.remove(&self.key);
        }
    }
}
