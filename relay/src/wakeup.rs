//! Wake-ups: what makes the workers claim now instead of at their next
//! poll. [`Wakeups`] is a generation counter the workers watch; [`listen`]
//! rings it at each of the producers' NOTIFY wake-ups. Notifications are
//! only a hint (a reconnecting listener misses some); the workers' polling
//! is the safety net, and every reconnect wakes them once to cover what was
//! missed.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use outbox_core::backoff::{Backoff, sleep_or_cancel};

/// The relay's wake-ups: a generation counter the workers watch. Clones
/// share it.
#[derive(Clone, Debug)]
pub(crate) struct Wakeups(watch::Sender<u64>);

impl Wakeups {
    pub(crate) fn new() -> Self {
        Self(watch::channel(0).0)
    }

    /// Wakes every worker waiting, and the next one to wait.
    pub(crate) fn wake(&self) {
        self.0.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// What a worker waits on: it changes at each wake-up.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// How long the listener may hear nothing before it checks its link (one
/// `SELECT 1`, bounded by the database timeout): a link gone silent would
/// otherwise leave it waiting for ever, polling alone doing the work.
const CHECK_WHEN_QUIET: Duration = Duration::from_secs(10);

/// Listens on `channel` until `shutdown`, waking the workers at every
/// notification and at every reconnect. Its connection is in a pool of its
/// own (one connection, opened with the relay pool's options): a listener
/// whose link stopped answering is dropped with that pool, so it never
/// holds a slot of the relay's.
pub(crate) async fn listen(
    pool: PgPool,
    channel: String,
    wakeups: Wakeups,
    shutdown: CancellationToken,
    timeout: Duration,
) {
    let bump = || wakeups.wake();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        let own = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(timeout)
            .connect_lazy_with((*pool.connect_options()).clone());
        let listener = async {
            let mut l = PgListener::connect_with(&own).await?;
            l.listen(&channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match tokio::time::timeout(timeout, listener).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                if backoff.failures() == 0 {
                    tracing::warn!(error = %e, "wake-up listener cannot connect; polling only until it can");
                }
                sleep_or_cancel(backoff.next_delay(), &shutdown).await;
                continue;
            }
            Err(_) => {
                // The connect timed out: that waited long enough.
                if backoff.failures() == 0 {
                    tracing::warn!(timeout = ?timeout, "wake-up listener got no answer from the database; polling only until it does");
                }
                let _ = backoff.next_delay();
                continue;
            }
        };
        if backoff.failures() > 0 {
            tracing::info!("wake-up listener connected again");
            backoff.reset();
        }
        bump();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = listener.try_recv() => match r {
                    Ok(Some(_)) => bump(),
                    // Connection lost; it reconnects on the next call.
                    // Notifications sent meanwhile are gone: wake anyway.
                    Ok(None) => bump(),
                    Err(e) => {
                        tracing::debug!(error = %e, "wake-up listener lost its connection");
                        bump();
                        break;
                    }
                },
                // `try_recv` is cancel-safe: a message half read stays in
                // the connection's buffer.
                _ = tokio::time::sleep(CHECK_WHEN_QUIET) => {
                    let check = sqlx::query("SELECT 1").execute(&mut listener);
                    if !matches!(tokio::time::timeout(timeout, check).await, Ok(Ok(_))) {
                        tracing::warn!(timeout = ?timeout, "wake-up listener's connection stopped answering; opening a new one (polling meanwhile)");
                        let _ = backoff.next_delay();
                        bump();
                        break;
                    }
                }
            }
        }
    }
}
