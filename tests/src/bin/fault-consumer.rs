//! A consumer (the outbox-consumer library) as a process the fault tests can SIGKILL. Its
//! effect is deliberately not idempotent: one row per application in
//! `<SCHEMA>.effects` (no unique key), so a double application shows.
//! Settings: DATABASE_URL, AMQP_URL, SCHEMA, QUEUE. It prints its counts
//! on stdout whenever they change (`processed=N duplicates=M`, a line each
//! time, the last one at exit), so a test sees duplicates it recognised
//! even when it is SIGKILLed a few milliseconds later. SIGINT or SIGTERM
//! stop it gracefully.

use anyhow::{Context, Result};
use outbox_consumer::{Consumer, ConsumerConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

#[tokio::main]
async fn main() -> Result<()> {
    // SIGTERM is handled from the first instant: the fault suites' judge
    // may stop a consumer it has just started (its queues already empty),
    // and one killed by the signal's default action before its handler
    // was installed would look like a consumer that did not stop cleanly.
    let stop = CancellationToken::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn({
        let stop = stop.clone();
        async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = outbox::shutdown_signal() => {}
            }
            stop.cancel();
        }
    });
    // Logs on stderr, filtered by RUST_LOG (the tests keep them per test).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let schema = env("SCHEMA")?;
    let options: PgConnectOptions = env("DATABASE_URL")?.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&format!("fault-consumer-{schema}")))
        .await?;
    let mut config = ConsumerConfig::new(env("AMQP_URL")?, env("QUEUE")?, "faults");
    config.schema = schema.to_string();
    config.declare_retry_queues = false;
    config.max_reconnect_delay = std::time::Duration::from_millis(500);
    let mut effect = e2e::RecordEffect::new(&schema);
    if let Ok(ms) = std::env::var("RETRY_FIRST_MS") {
        config.retry_delay = std::time::Duration::from_millis(ms.parse()?);
        effect = effect.retry_first();
    }
    let consumer = Consumer::new(config, pool, effect)?;
    let report = consumer.clone();
    let printer = tokio::spawn(async move {
        let mut last = None;
        loop {
            let s = report.stats();
            if last != Some((s.processed, s.duplicates)) {
                last = Some((s.processed, s.duplicates));
                println!("processed={} duplicates={}", s.processed, s.duplicates);
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    });
    let ended = consumer.run(stop).await;
    printer.abort();
    let s = consumer.stats();
    println!("processed={} duplicates={}", s.processed, s.duplicates);
    ended?;
    Ok(())
}
