//! Waits on conditions with deadlines (never sleep-and-hope).

use std::future::Future;
use std::time::{Duration, Instant};

/// How long a check begun near or after its wait's deadline may take.
const LAST_CHECK: Duration = Duration::from_secs(5);

/// Waits until `check` returns true, polling every 20 ms; panics with
/// `what` after `timeout`. The deadline bounds each check too: a check
/// that hangs (a broker call on a connection whose node died, say) fails
/// the wait at its deadline instead of hanging the test until the test
/// runner kills it without a word. (A check begun near or after the
/// deadline still gets 5 s to answer.)
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let by = deadline.max(Instant::now() + LAST_CHECK);
        match tokio::time::timeout_at(by.into(), check()).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(_) => panic!(
                "timed out after {timeout:?} waiting for {what} (the last check did not return)"
            ),
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
