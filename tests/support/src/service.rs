//! Example services as processes: graceful stops on signals, and what they
//! print when misconfigured.

use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use nix::sys::signal::Signal;

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
    crate::stop_child(&mut child, signal, deadline).await
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

/// The environment of an example consumer (`inventory`, `notifications`):
/// its own variables are `<PREFIX>_DATABASE_URL`, `<PREFIX>_SCHEMA` and
/// `<PREFIX>_QUEUE`.
pub fn consumer_env(
    prefix: &str,
    schema: &str,
    queue: &str,
    exchange: &str,
) -> Vec<(String, String)> {
    vec![
        (format!("{prefix}_DATABASE_URL"), crate::database_url()),
        ("AMQP_URL".to_owned(), crate::amqp_url()),
        (format!("{prefix}_SCHEMA"), schema.to_owned()),
        (format!("{prefix}_QUEUE"), queue.to_owned()),
        ("OUTBOX_EXCHANGE".to_owned(), exchange.to_owned()),
    ]
}

fn borrowed(env: &[(String, String)]) -> Vec<(&str, String)> {
    env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect()
}

/// An example consumer `bin` (named `name`, variables `prefix`) exits 0
/// on SIGTERM and on SIGINT once it is consuming; its queues, exchange and
/// schema are removed afterwards.
pub async fn consumer_stops_cleanly(bin: &str, name: &str, prefix: &str) {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let s = crate::suffix();
        let (schema, queue, exchange) = (
            format!("t_{name}_{s}"),
            format!("test.{name}.{s}"),
            format!("test.{name}.x.{s}"),
        );
        let env = consumer_env(prefix, &schema, &queue, &exchange);
        let ready = Ready::Consuming(queue.clone());
        let code = stop_with(bin, &borrowed(&env), &ready, signal).await;
        assert_eq!(code, Some(0), "{signal}: exit code");
        let conn = connect().await;
        let ch = conn.create_channel().await.expect("channel");
        for q in [
            queue.clone(),
            format!("{queue}.retry"),
            format!("{queue}.dlq"),
        ] {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let _ = ch
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
        let _ = conn.close(200, "ok".into()).await;
        let pool = sqlx::PgPool::connect(&crate::database_url())
            .await
            .expect("database");
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&pool)
        .await;
    }
}

/// An example consumer given each URL of [`BAD_AMQP_URLS`] and
/// [`BAD_DATABASE_URLS`] exits non-zero with one `<name>: ` line and no
/// password.
pub fn consumer_hides_passwords(bin: &str, name: &str, prefix: &str) {
    let s = crate::suffix();
    let base = consumer_env(
        prefix,
        &format!("t_{name}_{s}"),
        &format!("test.{name}.{s}"),
        "unused",
    );
    let database = format!("{prefix}_DATABASE_URL");
    let cases = BAD_AMQP_URLS
        .iter()
        .map(|u| ("AMQP_URL", *u))
        .chain(BAD_DATABASE_URLS.iter().map(|u| (database.as_str(), *u)));
    for (key, url) in cases {
        let mut env: Vec<(String, String)> =
            base.iter().filter(|(k, _)| k != key).cloned().collect();
        env.push((key.to_owned(), url.to_owned()));
        let (code, text) = run_to_exit(bin, &borrowed(&env));
        assert_ne!(code, Some(0), "{text}");
        assert!(!text.contains("S3cret"), "printed a password: {text}");
        assert!(text.starts_with(&format!("{name}: ")), "{text}");
    }
}
