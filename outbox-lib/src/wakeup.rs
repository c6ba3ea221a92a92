use std::time::Duration;

/// Bound on the notifier's connection attempts.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::sync::mpsc;

/// How relays learn that new events were committed. Whatever the mode, the
/// relay also polls, so a lost signal only delays an event by one poll
/// interval; it never loses it. See [`docs/WAKEUP.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAKEUP.md) for measurements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Wakeup {
    /// Default. After the producer commits ([`crate::Outbox::commit`] or
    /// [`crate::Outbox::wake`]), a background task sends one `NOTIFY` on its
    /// own connection, outside every producer transaction, with
    /// `synchronous_commit = off`. Concurrent wake-ups coalesce into one.
    /// Producers never take the NOTIFY lock, so they do not serialise.
    #[default]
    AfterCommit,
    /// `NOTIFY` inside the producer's transaction. Lowest latency and needs
    /// no call after commit, but every producer commit then takes a
    /// database-wide lock held through its WAL flush: producers serialise.
    /// For low write rates only.
    InTransaction,
    /// No signal; relays find events by polling.
    PollOnly,
}

/// The background task behind [`Wakeup::AfterCommit`].
#[derive(Debug)]
pub(crate) struct Notifier {
    tx: mpsc::Sender<()>,
}

impl Notifier {
    pub(crate) fn start(pool: &PgPool, channel: String) -> Self {
        // Capacity 1: a wake-up while one is pending is already covered.
        let (tx, rx) = mpsc::channel(1);
        let options = (*pool.connect_options())
            .clone()
            .options([("synchronous_commit", "off")])
            .application_name("outbox-notifier");
        tokio::spawn(run(options, channel, rx));
        Self { tx }
    }

    pub(crate) fn wake(&self) {
        // Full means a NOTIFY is already due; closed cannot happen while
        // `self` lives. Either way there is nothing to do.
        let _ = self.tx.try_send(());
    }
}

async fn run(
    options: sqlx::postgres::PgConnectOptions,
    channel: String,
    mut rx: mpsc::Receiver<()>,
) {
    let mut conn: Option<PgConnection> = None;
    let mut failing = false;
    // Ends when every Outbox handle (and so the sender) is dropped.
    while rx.recv().await.is_some() {
        if conn.is_none() {
            // Bounded: a silent network must not stall the notifier.
            let connected = tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await;
            match connected.unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut)) {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "outbox wake-up notifier cannot connect; relays fall back to polling");
                        failing = true;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let sent = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(&channel)
                .execute(&mut *c),
        )
        .await;
        match sent {
            Ok(Ok(_)) => {
                if failing {
                    tracing::info!("outbox wake-up notifier recovered");
                    failing = false;
                }
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(error = %e, "outbox wake-up NOTIFY failed; relays fall back to polling");
                    failing = true;
                }
                if let Some(c) = conn.take() {
                    let _ = c.close().await;
                }
            }
            Err(_) => {
                if !failing {
                    tracing::warn!("outbox wake-up NOTIFY timed out; relays fall back to polling");
                    failing = true;
                }
                // The connection is in an unknown state; drop it.
                conn = None;
            }
        }
    }
}
