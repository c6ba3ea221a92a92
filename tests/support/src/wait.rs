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
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_until_every(timeout, Duration::from_millis(20), what, check).await;
}

/// [`wait_until`], polling every `every`: for a check that costs more
/// than a round trip, such as one that runs `rabbitmqctl` (a VM boot,
/// about 0.6 s of CPU a look: polled every 20 ms, a wait on it took a core
/// from the tests beside it).
pub async fn wait_until_every<F, Fut>(timeout: Duration, every: Duration, what: &str, mut check: F)
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
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check that never returns (a broker call on a dead connection)
    /// fails the wait; before the bound it hung the test for ever.
    #[tokio::test]
    #[should_panic(expected = "the last check did not return")]
    async fn a_check_that_never_returns_fails_the_wait() {
        wait_until(Duration::from_millis(100), "a hung check", || {
            std::future::pending::<bool>()
        })
        .await;
    }

    /// A check that answers in time still ends the wait.
    #[tokio::test]
    async fn a_check_that_answers_ends_the_wait() {
        let mut calls = 0;
        wait_until(Duration::from_secs(5), "the third call", || {
            calls += 1;
            std::future::ready(calls == 3)
        })
        .await;
        assert_eq!(calls, 3);
    }
}
