//! One log line when a dependency goes away, one when it is back: never a
//! line per failed retry. Shared by the relay and the consumer.

use std::sync::Mutex;
use std::time::Instant;

/// Tracks whether a dependency (`"broker"`, `"database"`) of a component
/// (a relay, a consumer name) is in an outage.
#[derive(Debug)]
pub struct Outage {
    dependency: &'static str,
    component: String,
    since: Mutex<Option<Instant>>,
    /// When the last outage ended.
    recovered: Mutex<Option<Instant>>,
}

impl Outage {
    /// No outage yet.
    pub fn new(dependency: &'static str, component: impl Into<String>) -> Self {
        Self {
            dependency,
            component: component.into(),
            since: Mutex::new(None),
            recovered: Mutex::new(None),
        }
    }

    /// Records a failure of an attempt begun at `began`. One begun before
    /// the last outage ended (it waited on a connection that died in it,
    /// while another attempt already succeeded) belongs to that outage:
    /// logged at debug level, no new outage opened.
    pub fn failed_since(&self, began: Instant, error: &dyn std::error::Error) {
        {
            // Under `since`'s lock, which `ok` holds while it records the
            // recovery: no recovery slips in between.
            let since = self.since.lock().unwrap_or_else(|p| p.into_inner());
            let recovered = *self.recovered.lock().unwrap_or_else(|p| p.into_inner());
            if since.is_none() && recovered.is_some_and(|r| began < r) {
                let (component, dependency) = (self.component.as_str(), self.dependency);
                let error = error_chain(error);
                tracing::debug!(component, dependency, %error, "failed in the outage that ended");
                return;
            }
        }
        self.failed(error);
    }

    /// Records a failure; logs only the first of an outage.
    pub fn failed(&self, error: &dyn std::error::Error) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        let error = error_chain(error);
        let (component, dependency) = (self.component.as_str(), self.dependency);
        if since.is_none() {
            *since = Some(Instant::now());
            tracing::warn!(component, dependency, %error, "{dependency} unavailable; retrying with backoff");
        } else {
            tracing::debug!(component, dependency, %error, "still unavailable");
        }
    }

    /// Records a success; logs the end of an outage.
    pub fn ok(&self) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = since.take() {
            *self.recovered.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            let (component, dependency) = (self.component.as_str(), self.dependency);
            tracing::info!(
                component,
                dependency,
                outage_s = t.elapsed().as_secs_f64(),
                "{dependency} available again"
            );
        }
    }

    /// Whether an outage is in progress.
    pub fn is_down(&self) -> bool {
        self.since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

/// `error: cause: cause`, like anyhow's `{:#}`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_begun_before_the_recovery_opens_no_new_outage() {
        let outage = Outage::new("database", "test");
        let e = std::io::Error::other("connection lost");
        let early = Instant::now();
        outage.failed_since(early, &e);
        assert!(outage.is_down());
        outage.ok();
        assert!(!outage.is_down());
        // Began before the recovery: the outage that ended.
        outage.failed_since(early, &e);
        assert!(!outage.is_down());
        // Began after it: a new outage.
        outage.failed_since(Instant::now(), &e);
        assert!(outage.is_down());
    }
}
