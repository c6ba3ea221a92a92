//! `inventory`: the example stock consumer, on its own.

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;

/// Inventory consumer: takes each OrderPlaced event's quantity off the
/// stock, exactly once, whatever the duplicates.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// PostgreSQL URL of the inventory's own database [default: $DATABASE_URL].
    #[arg(long, env = "INVENTORY_DATABASE_URL", hide_env_values = true)]
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
    /// Schema holding the stock and inbox tables (migrated at start).
    #[arg(long, env = "INVENTORY_SCHEMA", default_value = "public")]
    schema: String,
    /// Queue to consume (declared, with its retry queue and DLQ).
    #[arg(long, env = "INVENTORY_QUEUE", default_value = inventory::DEFAULT_QUEUE)]
    queue: String,
    /// The relay's exchange, which the queue is bound to.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    exchange: String,
    /// Binding key of the queue.
    #[arg(long, default_value = "order.#")]
    binding_key: String,
    /// Set a stock level before consuming, as SKU=QTY (repeatable).
    #[arg(long, value_parser = parse_seed)]
    seed: Vec<(String, i64)>,
}

fn parse_seed(s: &str) -> Result<(String, i64), String> {
    let (sku, qty) = s.split_once('=').ok_or("expected SKU=QTY")?;
    let qty = qty
        .parse()
        .map_err(|e| format!("bad quantity {qty:?}: {e}"))?;
    Ok((sku.to_owned(), qty))
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
                "inventory: {}",
                outbox::redact::scrub_all(&format!("{e:#}"), &urls)
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let Some(database_url) = args.database_url else {
        bail!("set --database-url, INVENTORY_DATABASE_URL or DATABASE_URL");
    };
    outbox::urls::check_url(&database_url, "database URL", &["postgres", "postgresql"])
        .map_err(anyhow::Error::msg)?;
    outbox::urls::check_urls(&args.amqp_url, "AMQP URL", &["amqp", "amqps"])
        .map_err(anyhow::Error::msg)?;
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .context("connecting to PostgreSQL")?;
    let stock = inventory::Stock::setup(&pool, &args.schema)
        .await
        .with_context(|| format!("preparing schema {}", args.schema))?;
    for (sku, qty) in &args.seed {
        stock
            .seed(&pool, sku, *qty)
            .await
            .context("seeding stock")?;
    }
    inventory::declare_queue(
        &args.amqp_url,
        &args.queue,
        &args.exchange,
        &args.binding_key,
    )
    .await
    .with_context(|| format!("declaring queue {}", args.queue))?;
    let consumer = inventory::consumer(&args.amqp_url, &args.queue, &args.schema, pool, stock)?;
    tracing::info!(queue = %args.queue, schema = %args.schema, "inventory consuming");
    // SIGTERM or Ctrl-C: drain the batch in hand, then exit 0.
    consumer.run_until_signal().await.context("consuming")?;
    let stats = consumer.stats();
    tracing::info!(
        processed = stats.processed,
        duplicates = stats.duplicates,
        "inventory stopped"
    );
    Ok(())
}
