//! The relay engine as a process the fault tests can SIGKILL and SIGSTOP.
//! Settings from the environment: DATABASE_URL, AMQP_URL, SCHEMA, EXCHANGE,
//! BATCH_SIZE (default 100), LISTEN (default 1), LEASE_TTL_MS (default
//! 2000), NAME (relay name and database application name; default
//! `fault-relay-<schema>`), CAPTURE (`wal`: also read the schema's slot),
//! WAL_SENDER_TIMEOUT_MS (default 3000), MAX_PAYLOAD_BYTES, MAX_ATTEMPTS
//! and RETRY_BASE_MS (the relay's defaults when unset). SIGINT or SIGTERM
//! stop it gracefully. Logs go to stderr, filtered by RUST_LOG.

use std::time::Duration;

use anyhow::{Context, Result};
use outbox_relay::{Relay, RelayConfig, WalCapture};
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;

/// The relay's bound on each database call (and the pool's).
const DATABASE_TIMEOUT: Duration = Duration::from_secs(3);

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

#[tokio::main]
async fn main() -> Result<()> {
    // Logs on stderr, filtered by RUST_LOG (the tests keep them per test).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let schema = env("SCHEMA")?;
    let name = std::env::var("NAME").unwrap_or_else(|_| format!("fault-relay-{schema}"));
    let options: PgConnectOptions = env("DATABASE_URL")?.parse()?;
    let options = options.application_name(&name).options([
        ("statement_timeout", "10s"),
        ("idle_in_transaction_session_timeout", "3s"),
    ]);
    // Every wait on the pool bounded, as an embedding service should have
    // it (`outbox_relay::pool_options`): the silent-link cells need it.
    let pool = outbox_relay::pool_options(DATABASE_TIMEOUT)
        .max_connections(4)
        .connect_with(options)
        .await?;
    let config = {
        let mut c = RelayConfig::default();
        c.amqp_url = env("AMQP_URL")?.into();
        c.schema = schema;
        c.default_exchange = env("EXCHANGE")?;
        c.declare_exchange = None;
        c.batch_size = std::env::var("BATCH_SIZE")
            .ok()
            .and_then(|b| b.parse().ok())
            .unwrap_or(100);
        c.listen = std::env::var("LISTEN").map_or(true, |l| l != "0");
        c.poll_interval = Duration::from_millis(200);
        c.confirm_timeout = Duration::from_secs(3);
        c.broker_timeout = Duration::from_secs(3);
        c.database_timeout = DATABASE_TIMEOUT;
        c.reconnect_min = Duration::from_millis(50);
        c.reconnect_max = Duration::from_millis(500);
        c.lease_ttl = Duration::from_millis(
            std::env::var("LEASE_TTL_MS")
                .ok()
                .and_then(|b| b.parse().ok())
                .unwrap_or(2000),
        );
        c.name = name;
        let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = number("MAX_PAYLOAD_BYTES") {
            c.max_payload_bytes = n as usize;
        }
        if let Some(n) = number("MAX_ATTEMPTS") {
            c.max_attempts = n as i32;
        }
        if let Some(ms) = number("RETRY_BASE_MS") {
            c.retry_base = Duration::from_millis(ms);
            c.retry_max = Duration::from_millis(ms * 4);
        }
        if std::env::var("CAPTURE").is_ok_and(|c| c == "wal") {
            let mut wal = WalCapture::new(env("DATABASE_URL")?);
            wal.standby_poll = Duration::from_millis(200);
            wal.sender_timeout = Duration::from_millis(
                std::env::var("WAL_SENDER_TIMEOUT_MS")
                    .ok()
                    .and_then(|b| b.parse().ok())
                    .unwrap_or(3000),
            );
            c.wal = Some(wal);
        }
        c
    };
    let relay = Relay::new(pool, config).await?;
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            outbox::shutdown_signal().await;
            stop.cancel();
        }
    });
    relay.run(stop).await?;
    Ok(())
}
