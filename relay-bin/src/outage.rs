//! One log line when a dependency goes away, one when it is back: never a
//! line per failed retry.

use std::sync::Mutex;
use std::time::Instant;

/// Tracks whether a dependency (`"broker"`, `"database"`) is in an outage.
#[derive(Debug)]
pub(crate) struct Outage {
    name: &'static str,
    since: Mutex<Option<Instant>>,
}

impl Outage {
    pub(crate) const fn new(name: &'static str) -> Self {
        Self {
            name,
            since: Mutex::new(None),
        }
    }

    /// Records a failure; logs only the first of an outage.
    pub(crate) fn failed(&self, error: &dyn std::fmt::Display) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if since.is_none() {
            *since = Some(Instant::now());
            tracing::warn!(dependency = self.name, error = %error, "{} unavailable; retrying with backoff", self.name);
        } else {
            tracing::debug!(dependency = self.name, error = %error, "still unavailable");
        }
    }

    /// Records a success; logs the end of an outage.
    pub(crate) fn ok(&self) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = since.take() {
            tracing::info!(
                dependency = self.name,
                outage_s = t.elapsed().as_secs_f64(),
                "{} available again",
                self.name
            );
        }
    }

    pub(crate) fn is_down(&self) -> bool {
        self.since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}
