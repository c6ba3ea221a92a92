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
    state: Mutex<State>,
}

/// One lock for both instants: a failure is judged against the recovery
/// it may have raced with, atomically.
#[derive(Debug, Default)]
struct State {
    /// When the outage in progress began.
    since: Option<Instant>,
    /// When the last outage ended.
    recovered: Option<Instant>,
}

impl Outage {
    /// No outage yet.
    pub fn new(dependency: &'static str, component: impl Into<String>) -> Self {
        Self {
            dependency,
            component: component.into(),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failure of an attempt begun at `began`; returns whether it
    /// counts. One begun before the last outage ended (it waited on a
    /// connection that died in it, while another attempt already
    /// succeeded) belongs to that outage: logged at debug level, no new
    /// outage opened, and `false` (the dependency is not down again).
    pub fn failed_since(&self, began: Instant, error: &dyn std::error::Error) -> bool {
        let mut state = self.state();
        if state.since.is_none() && state.recovered.is_some_and(|r| began < r) {
            let (component, dependency) = (self.component.as_str(), self.dependency);
            let error = error_chain(error);
            tracing::debug!(component, dependency, %error, "failed in the outage that ended");
            return false;
        }
        self.record(&mut state, error);
        true
    }

    /// Records a failure; logs only the first of an outage.
    pub fn failed(&self, error: &dyn std::error::Error) {
        let mut state = self.state();
        self.record(&mut state, error);
    }

    fn record(&self, state: &mut State, error: &dyn std::error::Error) {
        let error = error_chain(error);
        let (component, dependency) = (self.component.as_str(), self.dependency);
        if state.since.is_none() {
            state.since = Some(Instant::now());
            tracing::warn!(component, dependency, %error, "{dependency} unavailable; retrying with backoff");
        } else {
            tracing::debug!(component, dependency, %error, "still unavailable");
        }
    }

    /// Records a success; logs the end of an outage.
    pub fn ok(&self) {
        let mut state = self.state();
        if let Some(t) = state.since.take() {
            state.recovered = Some(Instant::now());
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
        self.state().since.is_some()
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
        assert!(outage.failed_since(early, &e));
        assert!(outage.is_down());
        outage.ok();
        assert!(!outage.is_down());
        // Began before the recovery: the outage that ended.
        assert!(!outage.failed_since(early, &e));
        assert!(!outage.is_down());
        // Began after it: a new outage.
        assert!(outage.failed_since(Instant::now(), &e));
        assert!(outage.is_down());
    }
}
