//! `outbox-relay run`: the relay, until SIGTERM or SIGINT.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use outbox::Ident;
use outbox::redact::redact_urls;
use outbox_relay::{Fleet, FleetConfig, Relay, RelayConfig, WalCapture};
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
    tracing::info!(schema = %schema, exchange = %r.exchange, brokers = %redact_urls(&r.amqp_url.join(",")), "relay started");
    until_signal(r, move |shutdown| async move { relay.run(shutdown).await }).await
}

/// `outbox-relay run --all-schemas`: a fleet over DATABASE_URL's database
/// and --more-database-url's, until SIGTERM or SIGINT.
pub(super) async fn run_fleet(url: &str, r: &RunArgs, slow: Duration) -> Result<ExitCode> {
    if r.capture == CaptureArg::Wal {
        bail!(
            "--all-schemas serves the outbox tables only; the write-ahead-log capture needs a relay per schema (--schema S --capture wal)"
        );
    }
    // Its schema is not read: each tenant's is its own.
    let config = relay_config(url, &Ident::new("schema", "public")?, r);
    config.validate()?;
    let mut pools = Vec::new();
    // An empty entry (OUTBOX_MORE_DATABASE_URLS set but empty) is none.
    let more = r.more_database_url.iter().filter(|u| !u.trim().is_empty());
    for (i, url) in std::iter::once(url)
        .chain(more.map(String::as_str))
        .enumerate()
    {
        let pool = connect_db(url, r.workers as u32 + 2, slow, r.database_timeout)
            .await
            .with_context(|| format!("database {}", i + 1))?;
        pools.push(pool);
    }
    let mut fleet = FleetConfig::new(pools.clone(), config);
    fleet.like = r.like.clone();
    fleet.discover_every = r.discover_every;
    let fleet = Fleet::new(fleet)?;
    fleet.check_broker().await?;
    if let Some(addr) = r.metrics_addr {
        crate::http::serve_fleet(addr, fleet.clone(), pools.clone(), r.metrics_tenants).await?;
    }
    tracing::info!(databases = pools.len(), like = r.like.as_deref().unwrap_or("%"), exchange = %r.exchange, brokers = %redact_urls(&r.amqp_url.join(",")), "fleet started");
    until_signal(r, move |shutdown| async move { fleet.run(shutdown).await }).await
}

/// Runs `engine` until it returns or a signal comes, then until it has
/// drained (it bounds the drain by --drain-timeout itself).
async fn until_signal<F, Fut>(r: &RunArgs, engine: F) -> Result<ExitCode>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = outbox_relay::Result<()>> + Send + 'static,
{
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(outbox::shutdown_signal(), shutdown.clone()));
    let mut run = tokio::spawn(engine(shutdown.clone()));
    tokio::select! {
        res = &mut run => {
            signals.abort();
            res.context("relay task failed")??;
            return Ok(ExitCode::SUCCESS);
        }
        _ = shutdown.cancelled() => {}
    }
    tracing::info!(drain_timeout = ?r.drain_timeout, "shutting down: finishing batches in flight");
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
