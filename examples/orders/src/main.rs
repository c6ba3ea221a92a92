//! `orders`: the example orders API, on its own.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use tokio::net::TcpListener;

/// Orders API: POST /orders (Idempotency-Key required), GET /orders/{id},
/// GET /healthz. Each order and its OrderPlaced event commit in one
/// transaction; run `outbox-relay run` beside it to publish the events.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// PostgreSQL URL of the orders database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Address to listen on.
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    listen_addr: SocketAddr,
    /// Schema holding the outbox and the orders table (migrated at start).
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public")]
    schema: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    // Errors of the libraries below may quote the URL they were given.
    let urls = [args.database_url.clone()];
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "orders: {}",
                outbox::redact::scrub_all(&format!("{e:#}"), &urls)
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    outbox::urls::check_url(
        &args.database_url,
        "database URL",
        &["postgres", "postgresql"],
    )
    .map_err(anyhow::Error::msg)?;
    let pool = sqlx::PgPool::connect(&args.database_url)
        .await
        .context("connecting to PostgreSQL")?;
    let state = orders::setup(&pool, &args.schema)
        .await
        .with_context(|| format!("preparing schema {}", args.schema))?;
    // Before the port opens: a SIGTERM from then on is a graceful stop.
    let stop = outbox::shutdown_signal();
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("listening on {}", args.listen_addr))?;
    tracing::info!(addr = %listener.local_addr()?, schema = %args.schema, "orders API listening");
    axum::serve(listener, orders::router(state))
        // SIGTERM or Ctrl-C: finish the requests in flight, then exit 0.
        .with_graceful_shutdown(stop)
        .await
        .context("serving HTTP")
}
