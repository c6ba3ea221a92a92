//! `payments`: the HTTP API and the ledger consumer in one process.

use std::error::Error;

use outbox::sqlx::PgPool;
use outbox_consumer::Consumer;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // The relay's variables: both run against the same database and broker.
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let amqp_url = std::env::var("AMQP_URL").map_err(|_| "set AMQP_URL")?;
    let listen = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let schema = "public";

    let pool = PgPool::connect(&database_url).await?;
    payments::migrate(&pool, schema).await?;
    outbox_consumer::declare_topology_at(&amqp_url, &payments::ledger_topology()).await?;

    let ledger_config = payments::ledger_config(&amqp_url, schema);
    let ledger = Consumer::new(ledger_config, pool.clone(), payments::Ledger)?;
    let api = payments::router(&pool, schema).await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("payments: listening on http://{listen}");

    // Until SIGTERM or Ctrl-C; then both finish what they hold and stop.
    let serve = async {
        outbox::axum::serve(listener, api)
            .with_graceful_shutdown(outbox::shutdown_signal())
            .await
    };
    let (served, consumed) = tokio::join!(serve, ledger.run_until_signal());
    served?;
    consumed?;
    Ok(())
}
