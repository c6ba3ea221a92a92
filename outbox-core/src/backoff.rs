//! Exponential backoff with jitter, for reconnecting and for retries, and
//! the pause between attempts that a shutdown cuts short.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The delay before attempt number `attempt` (1 for the first retry):
/// `d = min(max, base * 2^(attempt-1))`, jittered to a random delay in
/// `[d/2, d]` so that many clients failing together do not retry
/// together.
pub fn jittered(base: Duration, max: Duration, attempt: u32) -> Duration {
    jitter(capped(base, max, attempt))
}

/// `min(max, base * 2^(attempt-1))`, without jitter (for delays the broker
/// applies, such as a retry queue's per-message TTL).
pub fn capped(base: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 1u32
        .checked_shl(attempt.saturating_sub(1).min(30))
        .unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(max)
}

/// A random delay in `[d/2, d]`.
pub fn jitter(d: Duration) -> Duration {
    let half = d / 2;
    // 53 random bits: a fraction in [0, 1).
    let fraction = (crate::random_u64() >> 11) as f64 / (1u64 << 53) as f64;
    half + d.saturating_sub(half).mul_f64(fraction)
}

/// Counts the failures of one outage: [`Backoff::next_delay`] gives the
/// jittered delay before the next try, [`Backoff::reset`] starts over
/// after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    /// First delay about `base`, doubling up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: 0,
        }
    }

    /// Records a failure and returns how long to wait before trying again.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        jittered(self.base, self.max, self.failures)
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// A success: the next failure waits about `base` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Records a failure and sleeps for [`Backoff::next_delay`]; false
    /// when `stop` fired first.
    pub async fn pause(&mut self, stop: &CancellationToken) -> bool {
        sleep_or_cancel(self.next_delay(), stop).await
    }
}

/// Sleeps for `d`, or until `stop` fires; whether it slept the whole of
/// `d`.
pub async fn sleep_or_cancel(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_is_capped_and_jittered() {
        let (base, max) = (Duration::from_millis(100), Duration::from_secs(5));
        for attempt in 1..40 {
            let d = jittered(base, max, attempt);
            let cap = (base * 2u32.pow((attempt - 1).min(10))).min(max);
            assert!(
                d >= cap / 2 && d <= cap,
                "attempt {attempt}: {d:?} not in [{:?}, {cap:?}]",
                cap / 2
            );
        }
        let samples: std::collections::HashSet<Duration> =
            (0..20).map(|_| jittered(base, max, 5)).collect();
        assert!(samples.len() > 1, "jitter varies the delay");
        assert_eq!(capped(base, max, 1), base);
        assert_eq!(capped(base, max, 3), base * 4);
        assert_eq!(capped(base, max, u32::MAX), max);
    }

    #[test]
    fn backoff_doubles_per_failure_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        assert!(b.next_delay() <= Duration::from_millis(100));
        assert!(b.next_delay() >= Duration::from_millis(100));
        for _ in 0..10 {
            assert!(b.next_delay() <= Duration::from_secs(1));
        }
        assert_eq!(b.failures(), 12);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
