//! Child processes: reaped on drop ([`KillOnDrop`]), frozen mid-batch,
//! killed, stopped by a signal.

use std::time::Duration;

use sqlx::PgPool;

use crate::{locked_rows, wait_until};

/// A child process that is SIGKILLed and reaped when dropped, so a test
/// that fails half-way leaves no process behind.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Freezes `child` (SIGSTOP) until a freeze catches it holding rows of
/// `table` locked (a batch in flight: claimed, not yet settled), trying at
/// most `attempts` times with a short run between tries. Returns the rows
/// it held, with the child still frozen; 0 (child running) when no freeze
/// landed inside a batch.
pub async fn freeze_mid_batch(
    child: &std::process::Child,
    pool: &PgPool,
    table: &str,
    attempts: u32,
) -> i64 {
    use nix::sys::signal::{Signal, kill};
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    for attempt in 0..attempts {
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        let locked = locked_rows(pool, table).await;
        if locked > 0 {
            return locked;
        }
        kill(pid, Signal::SIGCONT).expect("SIGCONT");
        tokio::time::sleep(Duration::from_millis(3 + u64::from(attempt * 7 % 11))).await;
    }
    0
}

/// SIGKILLs and reaps `child`.
pub fn kill_now(mut child: KillOnDrop) {
    use nix::sys::signal::{Signal, kill};
    let _ = kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGKILL,
    );
    let _ = child.wait();
}

/// Sends `signal` to `child` and waits (at most `timeout`) for it to exit;
/// returns its exit code (`None`: ended by a signal).
pub async fn stop_child(
    child: &mut KillOnDrop,
    signal: nix::sys::signal::Signal,
    timeout: Duration,
) -> Option<i32> {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal);
    wait_exit(child, timeout).await
}

/// Waits (at most `timeout`) for `child` to exit; returns its exit code
/// (`None`: ended by a signal).
pub async fn wait_exit(child: &mut KillOnDrop, timeout: Duration) -> Option<i32> {
    let mut status = None;
    wait_until(timeout, "the process to exit", || {
        let exited = child.try_wait().expect("poll");
        if exited.is_some() {
            status = exited;
        }
        std::future::ready(exited.is_some())
    })
    .await;
    status.and_then(|s| s.code())
}
