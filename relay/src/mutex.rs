//! Mutexes the relay shares between tasks (health, leases, stats, the
//! quarantine, the workers' claim states).

use std::sync::{Mutex, MutexGuard};

/// A mutex's guard, whether or not a panic poisoned it (the sets it guards
/// stay consistent at every await point).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
