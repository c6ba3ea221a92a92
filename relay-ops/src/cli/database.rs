//! The database connection every command opens: checked once up front, so
//! a wrong URL fails with its cause, then pooled.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use outbox::redact::{redact_url, scrub};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The bound on each database wait of the commands other than `run`
/// (which takes `--database-timeout`).
pub(super) const DATABASE_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool of at most `max` connections to `url`, every wait on it bounded
/// by `timeout`, slow statements logged past `slow`.
pub(super) async fn connect_db(
    url: &str,
    max: u32,
    slow: Duration,
    timeout: Duration,
) -> Result<PgPool> {
    outbox::urls::check_url(url, "database URL", &["postgres", "postgresql"])
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
    //
    // TCP keepalive on the server's side of each connection (the client's
    // socket is sqlx's, which sets none): a relay whose link went silent
    // loses its sessions, and with them its row and lease locks, within
    // about 25 s of probes instead of the kernel's fifteen minutes.
    let options = options
        .application_name("outbox-relay")
        .options([
            ("statement_timeout", "30s"),
            ("idle_in_transaction_session_timeout", "60s"),
            ("jit", "off"),
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
            ("tcp_user_timeout", "25000"),
        ])
        .log_slow_statements(log::LevelFilter::Warn, slow);
    // One direct connection first: its error names the cause (refused,
    // auth, TLS), where a pool would only report a timeout.
    let probe = tokio::time::timeout(timeout, PgConnection::connect_with(&options)).await;
    let context = || format!("cannot connect to the database at {}", redact_url(url));
    match probe {
        Ok(conn) => conn
            .with_context(context)?
            .close()
            .await
            .with_context(context)?,
        Err(_) => bail!("{}: no answer within {timeout:?}", context()),
    }
    // Every wait on the pool bounded (`outbox_relay::pool_options`): a connection
    // that stops answering is dropped, not waited for.
    Ok(outbox_relay::pool_options(timeout)
        .max_connections(max)
        .connect_lazy_with(options))
}
