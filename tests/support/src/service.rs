//! Example services as processes: graceful stops on signals, and what they
//! print when misconfigured.

use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{KillOnDrop, connect, wait_until};

/// What the service must be doing before it is signalled.
#[derive(Debug, Clone)]
pub enum Ready {
    /// Consuming this queue (it has a consumer).
    Consuming(String),
    /// Accepting TCP connections on this loopback port.
    Listening(u16),
}

/// Starts `bin` with `env`, waits until it is `ready`, sends `signal` and
/// returns its exit code (`None`: killed by a signal) once it has exited.
pub async fn stop_with(
    bin: &str,
    env: &[(&str, String)],
    ready: &Ready,
    signal: Signal,
) -> Option<i32> {
    let mut cmd = Command::new(bin);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = KillOnDrop(cmd.spawn().expect("start the service"));
    let deadline = Duration::from_secs(60);
    match ready {
        Ready::Consuming(queue) => {
            let conn = connect().await;
            wait_until(deadline, "the service consuming", || async {
                // A passive declare of a missing queue closes its channel:
                // a fresh one each time.
                let Ok(ch) = conn.create_channel().await else {
                    return false;
                };
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                match ch
                    .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                    .await
                {
                    Ok(q) => q.consumer_count() > 0,
                    Err(_) => false,
                }
            })
            .await;
            let _ = conn.close(200, "ok".into()).await;
        }
        Ready::Listening(port) => {
            wait_until(deadline, "the service listening", || async {
                tokio::net::TcpStream::connect(("127.0.0.1", *port))
                    .await
                    .is_ok()
            })
            .await;
        }
    }
    assert!(
        child.try_wait().expect("poll").is_none(),
        "the service exited before it was signalled"
    );
    kill(Pid::from_raw(child.id() as i32), signal).expect("signal");
    let mut status = None;
    wait_until(deadline, "the service to exit", || {
        let exited = child.try_wait().expect("poll");
        if exited.is_some() {
            status = exited;
        }
        std::future::ready(exited.is_some())
    })
    .await;
    status.and_then(|s| s.code())
}

/// Runs `bin` with `env` (expected to fail fast) and returns its exit code
/// and everything it printed.
pub fn run_to_exit(bin: &str, env: &[(&str, String)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the service");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// A free loopback port (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Malformed and unreachable URLs with a password in them: whatever the
/// shape, a service must not print the password (`S3cret`).
pub const BAD_AMQP_URLS: &[&str] = &[
    "amqp:guest:mq-S3cret-pw@127.0.0.1:5672/%2f",
    "amqp//guest:mq-S3cret-pw@127.0.0.1/",
    "amqp://guest:mq-S3cret-pw@127.0.0.1:notaport/%2f",
    "http://guest:mq-S3cret-pw@127.0.0.1/",
];

/// Like [`BAD_AMQP_URLS`], for PostgreSQL.
pub const BAD_DATABASE_URLS: &[&str] = &[
    "postgres:u:pg-S3cret-pw@127.0.0.1:5432/test",
    "postgres//u:pg-S3cret-pw@127.0.0.1/test",
    "postgres://u:pg-S3cret-pw@127.0.0.1:notaport/test",
];
