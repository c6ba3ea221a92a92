//! `outbox-relay run`: the relay, until SIGTERM or SIGINT.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use outbox::Ident;
use outbox::redact::redact_urls;
use outbox_relay::{Relay, RelayConfig, WalCapture};
use tokio_util::sync::CancellationToken;

use super::args::{CaptureArg, RunArgs};
use super::database::connect_db;
use super::wait_for_signal;

pub(super) async fn run_relay(
    url: &str,
    schema: &Ident,
    r: &RunArgs,
    slow: Duration,
) -> Result<ExitCode> {
    let config = relay_config(url, schema, r);
    config.validate()?;
    let pool = connect_db(url, r.workers as u32 + 2, slow, r.database_timeout).await?;
    let relay = Relay::new(pool.clone(), config).await?;
    // Fail fast with one line when the broker is unreachable at start;
    // after that the supervisor reconnects by itself.
    relay.check_broker().await?;
    if let Some(addr) = r.metrics_addr {
        crate::http::serve(addr, relay.health(), pool.clone(), schema.clone()).await?;
    }
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(outbox::shutdown_signal(), shutdown.clone()));
    tracing::info!(schema = %schema, exchange = %r.exchange, brokers = %redact_urls(&r.amqp_url.join(",")), "relay started");
    let mut run = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    tokio::select! {
        res = &mut run => {
            signals.abort();
            res.context("relay task failed")??;
            return Ok(ExitCode::SUCCESS);
        }
        _ = shutdown.cancelled() => {}
    }
    tracing::info!(drain_timeout = ?r.drain_timeout, "shutting down: finishing batches in flight");
    // The engine bounds the drain by `drain_timeout` itself.
    run.await.context("relay task failed")??;
    tracing::info!("drained; bye");
    Ok(ExitCode::SUCCESS)
}

/// The engine's config from the flags (not validated yet).
fn relay_config(url: &str, schema: &Ident, r: &RunArgs) -> RelayConfig {
    // `RelayConfig` is `#[non_exhaustive]`: set field by field on the defaults.
    let mut config = RelayConfig::default();
    config.amqp_url = r.amqp_url.join(",").into();
    config.schema = schema.to_string();
    config.default_exchange = r.exchange.clone();
    config.declare_exchange = (r.declare_exchange != "none").then(|| r.declare_exchange.clone());
    config.batch_size = r.batch_size;
    config.workers = r.workers;
    config.poll_interval = r.poll_interval;
    config.listen = !r.no_listen;
    config.max_attempts = r.max_attempts;
    config.retry_base = r.retry_base;
    config.retry_max = r.retry_max;
    config.confirm_timeout = r.confirm_timeout;
    config.broker_timeout = r.broker_timeout;
    config.database_timeout = r.database_timeout;
    config.max_payload_bytes = r.max_payload_bytes;
    config.archive = r.archive;
    config.archive_retention = r.archive_retention;
    config.drain_timeout = r.drain_timeout;
    config.lease_ttl = r.lease_ttl;
    if let Some(name) = &r.name {
        config.name = name.clone();
    }
    if r.capture == CaptureArg::Wal {
        // The replication connection goes where the pool goes.
        let mut wal = WalCapture::new(url);
        wal.sender_timeout = r.wal_sender_timeout;
        config.wal = Some(wal);
    }
    config
}
