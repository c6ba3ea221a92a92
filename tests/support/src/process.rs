//! Child processes: reaped on drop ([`KillOnDrop`]), frozen mid-batch,
//! killed, stopped by a signal.

use std::time::Duration;

use sqlx::PgPool;

use crate::{locked_rows, wait_until};

/// Runs `cmd` to its end: its exit code and what it wrote, stdout then
/// stderr.
pub fn output(cmd: &mut std::process::Command) -> (Option<i32>, String) {
    let out = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("the command starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

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

/// Where a test's child processes write their stderr: one file each in a
/// directory of the test's own, printed (the last lines of each) when the
/// test fails and deleted when it passes. A wait that times out then shows
/// what the processes were doing, not only what the test saw.
#[derive(Debug)]
pub struct ProcessLogs {
    dir: std::path::PathBuf,
    next: std::sync::atomic::AtomicUsize,
}

impl ProcessLogs {
    /// Lines of each log printed when the test fails.
    const TAIL: usize = 60;

    /// A directory for the logs of the test named `name` (its schema).
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join("outbox-test-logs").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the processes' logs");
        Self {
            dir,
            next: Default::default(),
        }
    }

    /// Sends `command`'s stderr to a new file named after `what`.
    pub fn attach(&self, command: &mut std::process::Command, what: &str) {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.dir.join(format!("{n:02}-{what}.log"));
        let file = std::fs::File::create(&path).expect("a process log file");
        command.stderr(file);
    }

    /// The last lines of every log, oldest process first.
    pub fn tails(&self) -> String {
        let mut files: Vec<_> = std::fs::read_dir(&self.dir)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        let mut out = String::new();
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(Self::TAIL);
            out.push_str(&format!(
                "--- {} (last {} of {} lines)\n",
                path.display(),
                lines.len() - from,
                lines.len()
            ));
            for line in &lines[from..] {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for ProcessLogs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the processes' logs:\n{}", self.tails());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `outbox-relay run` (the binary at `bin`: a test of the package that
/// builds it passes `env!("CARGO_BIN_EXE_outbox-relay")`) publishing
/// `db`'s outbox to `broker`'s exchange, which it does not declare,
/// polling every 100 ms, with `db`'s capture; its output discarded and
/// its log at `warn`. Set more with `.env(..)`; spawn it into a
/// [`KillOnDrop`].
pub fn relay_command(
    bin: &str,
    db: &crate::TestDb,
    broker: &crate::TestBroker,
) -> std::process::Command {
    use std::process::Stdio;
    let mut c = std::process::Command::new(bin);
    c.env("DATABASE_URL", crate::database_url())
        .env("AMQP_URL", crate::amqp_url())
        .env("OUTBOX_SCHEMA", &db.schema)
        .env("OUTBOX_EXCHANGE", &broker.exchange)
        .env("OUTBOX_DECLARE_EXCHANGE", "none")
        .env("OUTBOX_POLL_INTERVAL", "100ms")
        .env("RUST_LOG", "warn")
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if db.capture == outbox::Capture::Wal {
        c.env("OUTBOX_CAPTURE", "wal");
    }
    c
}

/// Waits until something accepts connections on loopback `port`.
pub async fn wait_for_port(port: u16, what: &str) {
    wait_until(Duration::from_secs(30), what, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
}
