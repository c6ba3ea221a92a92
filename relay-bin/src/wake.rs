//! Wake-up: LISTEN for the outbox's NOTIFY channel and bump a generation
//! counter the workers watch. Notifications are only a hint (a reconnecting
//! listener misses some); the workers' polling is the safety net, and every
//! reconnect wakes them once to cover what was missed.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use outbox_core::backoff::Backoff;

pub(crate) async fn listen(
    pool: PgPool,
    channel: String,
    wake: watch::Sender<u64>,
    shutdown: CancellationToken,
) {
    let bump = || wake.send_modify(|g| *g = g.wrapping_add(1));
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(&channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match tokio::time::timeout(Duration::from_secs(10), listener).await {
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
                }
            }
        }
    }
}

pub(crate) async fn sleep_or_cancel(d: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.cancelled() => {}
    }
}
