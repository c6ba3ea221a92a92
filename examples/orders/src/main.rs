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
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orders: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let pool = sqlx::PgPool::connect(&args.database_url)
        .await
        .context("connecting to PostgreSQL")?;
    let state = orders::setup(&pool, &args.schema)
        .await
        .with_context(|| format!("preparing schema {}", args.schema))?;
    let listener = TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("listening on {}", args.listen_addr))?;
    tracing::info!(addr = %listener.local_addr()?, schema = %args.schema, "orders API listening");
    axum::serve(listener, orders::router(state))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving HTTP")
}
