//! The database connection every command opens: checked once up front, so
//! a wrong URL fails with its cause, then pooled.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use outbox::redact::{redact_url, scrub};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

pub(super) async fn connect_db(url: &str, max: u32, slow: Duration) -> Result<PgPool> {
    outbox::redact::check_url(url, "database URL", &["postgres", "postgresql"])
        .map_err(anyhow::Error::msg)?;
    // sqlx's parse errors do not quote the URL; say which setting anyway.
    let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
        anyhow::anyhow!("database URL is malformed: {}", scrub(&e.to_string(), url))
    })?;
    // Bounds on the database side: no statement runs forever, and a relay
    // frozen inside a transaction (SIGSTOP, a hung broker) loses its
    // session and its row locks instead of holding them for ever. No JIT:
    // these are short statements, and on a table never analysed the
    // planner's inflated costs made PostgreSQL compile one for 275 ms that
    // then ran in 2 ms (the console's blocked page).
    let options = options
        .application_name("outbox-relay")
        .options([
            ("statement_timeout", "30s"),
            ("idle_in_transaction_session_timeout", "60s"),
            ("jit", "off"),
        ])
        .log_slow_statements(log::LevelFilter::Warn, slow);
    // One direct connection first: its error names the cause (refused,
    // auth, TLS), where a pool would only report a timeout.
    let probe = tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await;
    let context = || format!("cannot connect to the database at {}", redact_url(url));
    match probe {
        Ok(conn) => conn
            .with_context(context)?
            .close()
            .await
            .with_context(context)?,
        Err(_) => bail!("{}: no answer within 10s", context()),
    }
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        // A round trip (a ping) at an acquire only where a connection sat
        // idle long enough to have gone stale (a restarted database, a
        // dropped link): sqlx's default pings on every acquire, which put
        // one more round trip between a wake-up and the publish of a batch
        // (workers now hold their connection from batch to batch while they
        // find work). A connection that died in between fails its batch,
        // which is retried like any database error; the worker gives it
        // back, and the pool's test of a returned connection drops it.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IF_IDLE {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_lazy_with(options))
}

/// How long a pooled connection may sit idle before it is pinged at its
/// next acquire: over the default poll interval (500 ms), so neither a busy
/// nor an idle relay pings on every batch.
const PING_IF_IDLE: Duration = Duration::from_secs(2);
