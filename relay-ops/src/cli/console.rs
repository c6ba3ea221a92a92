//! `outbox-relay console`: the operator console's options from the flags,
//! served until SIGTERM or SIGINT.

use std::time::Duration;

use anyhow::Result;
use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::args::ConsoleArgs;
use super::wait_for_signal;
use crate::console::{ConsumerOptions, Credentials, Options};

pub(super) async fn console(
    pool: PgPool,
    schema: &Ident,
    url: &str,
    c: &ConsoleArgs,
) -> Result<()> {
    let options = console_options(schema, url, c)?;
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(outbox::shutdown_signal(), shutdown.clone()));
    let served = crate::console::serve(pool, schema.clone(), options, shutdown).await;
    signals.abort();
    served
}

fn console_options(schema: &Ident, url: &str, c: &ConsoleArgs) -> Result<Options> {
    Ok(Options {
        listen: c.listen,
        base_path: c.base_path.trim_end_matches('/').to_owned(),
        read_only: c.read_only,
        credentials: Credentials::from_env(&c.user),
        retention: c.retention,
        refresh: c.refresh.max(Duration::from_millis(100)),
        database_url: url.to_owned(),
        consumers: ConsumerOptions::new(
            &c.amqp_url,
            &c.consumer_queue,
            c.inbox_schema.as_deref().unwrap_or(schema.as_str()),
        )?,
    })
}
