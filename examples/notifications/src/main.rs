//! `notifications`: the example notifications consumer, on its own.

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;

/// Notifications consumer: records one notification per OrderPlaced
/// event, exactly once, whatever the duplicates.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// PostgreSQL URL of the notifications's own database [default: $DATABASE_URL].
    #[arg(long, env = "NOTIFICATIONS_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// RabbitMQ URL, or the URLs of every node of a cluster separated by
    /// commas (default: the local broker, guest account).
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Schema holding the notifications and inbox tables (migrated at start).
    #[arg(long, env = "NOTIFICATIONS_SCHEMA", default_value = "public")]
    schema: String,
    /// Queue to consume (declared, with its retry queue and DLQ).
    #[arg(long, env = "NOTIFICATIONS_QUEUE", default_value = notifications::DEFAULT_QUEUE)]
    queue: String,
    /// The relay's exchange, which the queue is bound to.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    exchange: String,
    /// Binding key of the queue.
    #[arg(long, default_value = "order.#")]
    binding_key: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut args = Args::parse();
    if args.database_url.is_none() {
        args.database_url = std::env::var("DATABASE_URL").ok();
    }
    // Errors of the libraries below may quote the URLs they were given.
    let urls: Vec<String> = [Some(args.amqp_url.clone()), args.database_url.clone()]
        .into_iter()
        .flatten()
        .collect();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "notifications: {}",
                outbox::redact::scrub_all(&format!("{e:#}"), &urls)
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let Some(database_url) = args.database_url else {
        bail!("set --database-url, NOTIFICATIONS_DATABASE_URL or DATABASE_URL");
    };
    outbox::urls::check_url(&database_url, "database URL", &["postgres", "postgresql"])
        .map_err(anyhow::Error::msg)?;
    outbox::urls::check_urls(&args.amqp_url, "AMQP URL", &["amqp", "amqps"])
        .map_err(anyhow::Error::msg)?;
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .context("connecting to PostgreSQL")?;
    let notes = notifications::Notifications::setup(&pool, &args.schema)
        .await
        .with_context(|| format!("preparing schema {}", args.schema))?;
    notifications::declare_queue(
        &args.amqp_url,
        &args.queue,
        &args.exchange,
        &args.binding_key,
    )
    .await
    .with_context(|| format!("declaring queue {}", args.queue))?;
    let consumer = notifications::consumer(&args.amqp_url, &args.queue, &args.schema, pool, notes)?;
    tracing::info!(queue = %args.queue, schema = %args.schema, "notifications consuming");
    // SIGTERM or Ctrl-C: drain the batch in hand, then exit 0.
    consumer.run_until_signal().await.context("consuming")?;
    let stats = consumer.stats();
    tracing::info!(
        processed = stats.processed,
        duplicates = stats.duplicates,
        "notifications stopped"
    );
    Ok(())
}
