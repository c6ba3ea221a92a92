//! The relay's database seam: every round trip bounded from the client's
//! side, and a connection that did not answer in time never used again.
//!
//! PostgreSQL's own bounds (`statement_timeout`,
//! `idle_in_transaction_session_timeout`) end work the server can see; they
//! cannot help a client whose link went silent (a dead NAT entry, a
//! failed-over load balancer: no RST ever comes), which waits for an answer
//! that is not coming until the kernel gives up, about fifteen minutes
//! later. So each of the relay's database calls is raced against
//! [`RelayConfig::database_timeout`](crate::RelayConfig::database_timeout);
//! one that loses leaves its connection [discarded](discard), never given
//! back to the pool (whose test of a returned connection, a ping, would
//! wait just as long), and marks every pooled connection opened before it
//! as suspect: the pools of [`pool_options`] close those at their next
//! acquire or release instead of pinging them. A cancelled `BEGIN` cannot
//! leak an open transaction into the pool this way: its connection is
//! never returned.

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPoolOptions;

use crate::error::{Error, Result};

/// `f`, a database round trip named `what`, bounded by `timeout`; a call
/// that does not finish in time is [`Error::DatabaseTimeout`] (and the
/// caller must [`discard`] the connection it ran on).
pub(crate) async fn bounded<T, E: Into<Error>>(
    what: &'static str,
    timeout: Duration,
    f: impl Future<Output = std::result::Result<T, E>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => {
            suspect_older_connections();
            Err(Error::DatabaseTimeout { what, timeout })
        }
    }
}

/// `f` on a connection of `pool`, the acquire and `f` each bounded by
/// `timeout`; on a timeout the connection is [discarded](discard), never
/// given back (whatever pool options an embedding service chose).
pub(crate) async fn on_pool<T>(
    pool: &sqlx::PgPool,
    what: &'static str,
    timeout: Duration,
    f: impl AsyncFnOnce(&mut sqlx::PgConnection) -> sqlx::Result<T>,
) -> Result<T> {
    let mut conn = bounded("a connection from the pool", timeout, pool.acquire()).await?;
    let r = tokio::time::timeout(timeout, f(&mut conn)).await;
    match r {
        Ok(r) => r.map_err(Error::Database),
        Err(_) => {
            discard(conn);
            suspect_older_connections();
            Err(Error::DatabaseTimeout { what, timeout })
        }
    }
}

/// Closes `conn` instead of giving it back to the pool: sqlx sends its
/// `Terminate` from a task of its own, bounded (5 s), and the pool opens a
/// new connection in its place when one is needed.
pub(crate) fn discard(mut conn: PoolConnection<Postgres>) {
    conn.close_on_drop();
    drop(conn);
}

/// When a connection last failed to answer in time (process-wide: a
/// connection that went silent says the link may have, so every pooled
/// connection older than that is suspect).
static SILENT_SINCE: Mutex<Option<Instant>> = Mutex::new(None);

fn suspect_older_connections() {
    *SILENT_SINCE.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
}

/// Whether a pooled connection `age` old was opened before the last
/// connection that did not answer in time.
fn is_suspect(age: Duration) -> bool {
    SILENT_SINCE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_some_and(|since| age > since.elapsed())
}

/// How long a pooled connection may sit idle before its next acquire tests
/// it (a ping): over the default poll interval (500 ms), so neither a busy
/// nor an idle relay pings on every batch.
const PING_IF_IDLE: Duration = Duration::from_secs(2);

/// Pool options whose every wait is bounded by `timeout`, for the pool a
/// relay runs on (the binary's; an embedding service should build its
/// pool for the relay with them too):
///
/// - acquiring a connection, test included, waits at most `timeout`;
/// - a connection idle for a while is pinged at its next acquire, the ping
///   bounded by `timeout`, and one that does not answer is dropped;
/// - a connection given back is pinged, bounded by `timeout`, before the
///   pool takes it (sqlx's own test of a returned connection has no bound:
///   on a silent link it held a pool slot for about fifteen minutes);
/// - connections opened before one that did not answer in time are closed
///   at their next acquire or release, not tested.
///
/// ```no_run
/// # async fn demo() -> Result<(), sqlx::Error> {
/// use std::time::Duration;
/// let pool = outbox_relay::pool_options(Duration::from_secs(10))
///     .max_connections(5)
///     .connect("postgres://app@127.0.0.1/shop")
///     .await?;
/// # Ok(()) }
/// ```
pub fn pool_options(timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .acquire_timeout(timeout)
        // A round trip at an acquire only where a connection sat idle long
        // enough to have gone stale: sqlx's default pings on every acquire,
        // one more round trip between a wake-up and a batch's publish.
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if is_suspect(meta.age) {
                    return Ok(false);
                }
                if meta.idle_for >= PING_IF_IDLE {
                    ping(conn, timeout).await?;
                }
                Ok(true)
            })
        })
        .after_release(move |conn, meta| {
            Box::pin(async move {
                if is_suspect(meta.age) {
                    return Ok(false);
                }
                ping(conn, timeout).await?;
                Ok(true)
            })
        })
}

async fn ping(conn: &mut sqlx::PgConnection, timeout: Duration) -> sqlx::Result<()> {
    match tokio::time::timeout(timeout, sqlx::Connection::ping(conn)).await {
        Ok(r) => r,
        Err(_) => {
            suspect_older_connections();
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to a ping within {timeout:?}"),
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_older_than_a_silence_are_suspect() {
        suspect_older_connections();
        assert!(is_suspect(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!is_suspect(Duration::from_millis(5)));
    }

    #[tokio::test]
    async fn a_call_over_its_bound_is_a_database_timeout() {
        let slow = async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok::<_, sqlx::Error>(())
        };
        let e = bounded("claim", Duration::from_millis(10), slow)
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::DatabaseTimeout { what: "claim", .. }),
            "{e}"
        );
        assert!(e.is_transient() && !e.is_broker(), "{e}");
    }
}
