//! `outbox-relay run`: the relay, until SIGTERM or SIGINT.

use std::process::ExitCode;
use std::time::Duration;

use crate::{Relay, RelayConfig, WalCapture};
use anyhow::{Context, Result};
use outbox::Ident;
use outbox::redact::redact_urls;
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
    let mut config = RelayConfig {
        amqp_url: r.amqp_url.join(",").into(),
        schema: schema.to_string(),
        default_exchange: r.exchange.clone(),
        declare_exchange: (r.declare_exchange != "none").then(|| r.declare_exchange.clone()),
        batch_size: r.batch_size,
        workers: r.workers,
        poll_interval: r.poll_interval,
        listen: !r.no_listen,
        max_attempts: r.max_attempts,
        retry_base: r.retry_base,
        retry_max: r.retry_max,
        confirm_timeout: r.confirm_timeout,
        broker_timeout: r.broker_timeout,
        database_timeout: r.database_timeout,
        max_payload_bytes: r.max_payload_bytes,
        archive: r.archive,
        archive_retention: r.archive_retention,
        drain_timeout: r.drain_timeout,
        lease_ttl: r.lease_ttl,
        ..RelayConfig::default()
    };
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
