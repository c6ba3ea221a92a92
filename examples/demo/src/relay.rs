//! The relay, embedded: started, crashed and restarted by the demo.

use anyhow::{Context, Result};
use outbox_relay::{Relay, RelayConfig};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::env::{EXCHANGE, SCHEMA};

/// A running relay.
#[derive(Debug)]
pub(crate) struct RunningRelay {
    task: JoinHandle<outbox_relay::Result<()>>,
    stop: CancellationToken,
}

/// The relay's settings: small batches, so that a crash has some in
/// flight.
pub(crate) fn config(amqp_url: &str) -> RelayConfig {
    let mut c = RelayConfig::default();
    c.amqp_url = amqp_url.to_owned().into();
    c.schema = SCHEMA.to_owned();
    c.default_exchange = EXCHANGE.to_owned();
    c.batch_size = 50;
    c.workers = 2;
    c
}

/// Starts a fresh relay (a new process would start the same way).
pub(crate) async fn start(pool: &PgPool, config: &RelayConfig) -> Result<RunningRelay> {
    let relay = Relay::new(pool.clone(), config.clone())
        .await
        .context("starting the relay")?;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    Ok(RunningRelay { task, stop })
}

impl RunningRelay {
    /// Crashes it: its tasks are aborted wherever they are, batches in
    /// flight included (published, maybe confirmed, never settled); their
    /// rows stay in the outbox for the next relay.
    pub(crate) fn kill(self) {
        self.task.abort();
        // Only the wake-up listener outlives the abort; end it too.
        self.stop.cancel();
    }

    /// Stops it gracefully: batches in flight are finished.
    pub(crate) async fn stop(self) -> Result<()> {
        self.stop.cancel();
        self.task.await?.context("relay failed")
    }
}
