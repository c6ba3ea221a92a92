//! `make demo`: the whole story on this machine. An orders service takes
//! orders over HTTP with `Idempotency-Key`s (clients retry), writes each
//! order and its event in one transaction; a relay publishes them and is
//! crashed mid-stream, twice; duplicates are injected into the queues; an
//! inventory and a notifications consumer apply each event once. A report
//! and its checks end it; the exit code is non-zero if a check fails.

mod broker;
mod client;
mod env;
mod progress;
mod relay;
mod report;
mod traffic;
mod wire;

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use outbox_consumer::Consumer;
use outbox_relay::RelayConfig;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::env::{BINDING_KEY, EXCHANGE, INVENTORY_QUEUE, NOTIFICATIONS_QUEUE, SCHEMA};
use crate::progress::Progress;
use crate::relay::RunningRelay;
use crate::report::{INITIAL_STOCK, Sources};
use crate::traffic::{SKUS, Traffic};
use crate::wire::Wire;

/// Longest wait for the relay and the consumers to catch up at the end.
const CATCH_UP: Duration = Duration::from_secs(30);

/// The outbox toolkit's demo: orders over HTTP, a crashing relay, duplicate
/// deliveries, two dedup consumers, and checks.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL; the demo creates and uses the databases demo_orders,
    /// demo_inventory and demo_notifications on that server.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// RabbitMQ URL, or the URLs of every node of a cluster separated by
    /// commas: every service of the demo is given them all (default: the
    /// local broker, guest account).
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Orders to place.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(100..))]
    orders: u64,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    clients: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    // Quiet two libraries: lapin logs an ERROR when the relay and the
    // consumers close their connections on shutdown (their own outage
    // lines are enough), and sqlx a notice when the connection of a relay
    // killed mid-transaction is cleaned up (a real crash would not).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=off,sqlx::postgres::notice=off".into()),
        )
        .init();
    let args = Args::parse();
    // Errors of the libraries below may quote the URLs they were given.
    let urls = [args.amqp_url.clone(), args.database_url.clone()];
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("demo: a check FAILED");
            ExitCode::from(1)
        }
        Err(e) => {
            let e = outbox::redact::scrub_all(&format!("{e:#}"), &urls);
            eprintln!("demo: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<bool> {
    let started = Instant::now();
    let total = args.orders as usize;
    outbox::urls::check_urls(&args.amqp_url, "AMQP URL", &["amqp", "amqps"])
        .map_err(anyhow::Error::msg)?;
    let dbs = env::databases(&args.database_url).await?;
    let broker = Arc::new(Broker::new(&args.amqp_url));
    env::reset_broker(&broker).await?;

    // The three services, each on its own database.
    let state = orders::setup(&dbs.orders, SCHEMA)
        .await
        .context("setting up the orders service")?;
    let orders_store = state.orders().clone();
    let stock = inventory::Stock::setup(&dbs.inventory, SCHEMA).await?;
    for sku in SKUS {
        stock.seed(&dbs.inventory, sku, INITIAL_STOCK).await?;
    }
    let notes = notifications::Notifications::setup(&dbs.notifications, SCHEMA).await?;
    inventory::declare_queue(&args.amqp_url, INVENTORY_QUEUE, EXCHANGE, BINDING_KEY).await?;
    notifications::declare_queue(&args.amqp_url, NOTIFICATIONS_QUEUE, EXCHANGE, BINDING_KEY)
        .await?;
    env::declare_audit_queue(&broker).await?;
    println!(
        "demo: demo_orders, demo_inventory, demo_notifications migrated (schema {SCHEMA}); \
         stock {INITIAL_STOCK} of each of {}",
        SKUS.join(", ")
    );

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let http_stop = CancellationToken::new();
    let http = tokio::spawn(
        axum::serve(listener, orders::router(state))
            .with_graceful_shutdown(http_stop.clone().cancelled_owned())
            .into_future(),
    );
    let inventory = inventory::consumer(
        &args.amqp_url,
        INVENTORY_QUEUE,
        SCHEMA,
        dbs.inventory.clone(),
        stock.clone(),
    )?;
    let notifier = notifications::consumer(
        &args.amqp_url,
        NOTIFICATIONS_QUEUE,
        SCHEMA,
        dbs.notifications.clone(),
        notes.clone(),
    )?;
    let consumers_stop = CancellationToken::new();
    let consumer_tasks = [inventory.clone(), notifier.clone()].map(|c| {
        let stop = consumers_stop.clone();
        tokio::spawn(async move { c.run(stop).await })
    });
    let wire = Arc::new(Wire::default());
    let tap = wire::tap(broker.clone(), wire.clone());
    let relay_config = relay::config(&args.amqp_url);
    let mut relay = relay::start(&dbs.relay, &relay_config).await?;
    println!(
        "demo: orders API on http://{addr}; relay, inventory and notifications consumers running; \
         {} clients placing {total} orders",
        args.clients
    );

    let traffic = Arc::new(Traffic::default());
    let driving = tokio::spawn(traffic::drive(
        addr,
        total,
        args.clients as usize,
        traffic.clone(),
    ));
    let abandoning = tokio::spawn({
        let pool = dbs.orders.clone();
        async move { traffic::abandon(&orders_store, &pool, 100).await }
    });
    let progress = Progress {
        started,
        total,
        traffic: traffic.clone(),
        wire: wire.clone(),
        inventory: inventory.clone(),
        notifications: notifier.clone(),
        orders_db: dbs.orders.clone(),
    };
    let ticker = progress.clone().spawn();

    // Trouble, at fixed points of the stream.
    let accepted = || traffic.accepted.load(Ordering::SeqCst) as usize;
    let mut crashes = 0;
    reach(&driving, || accepted() >= total / 3).await;
    relay = crash_and_restart(relay, &wire, &dbs.relay, &relay_config, accepted()).await?;
    crashes += 1;
    reach(&driving, || accepted() >= total / 2).await;
    let mut injected = inject(&broker, &wire, 150, 1).await?;
    reach(&driving, || accepted() >= total * 2 / 3).await;
    relay = crash_and_restart(relay, &wire, &dbs.relay, &relay_config, accepted()).await?;
    crashes += 1;
    driving.await.context("HTTP clients")?;
    let abandoned = abandoning.await?.context("rolled-back transactions")?;
    println!("demo: all orders sent; waiting for the relay to drain the outbox");

    let drained = wait(CATCH_UP, || async {
        outbox_backlog(&dbs.orders).await == 0 && wire.distinct() >= accepted() as u64
    })
    .await;
    if drained {
        // Copies of events long applied, each sent twice back to back.
        injected += inject(&broker, &wire, 100, 2).await?;
    }
    settle(&broker, &inventory, &notifier, wire.distinct() + injected).await;
    ticker.abort();
    progress.print().await;

    relay.stop().await?;
    consumers_stop.cancel();
    for task in consumer_tasks {
        task.await?.context("consumer failed")?;
    }
    http_stop.cancel();
    http.await?.context("orders API")?;
    tap.abort();

    let facts = Sources {
        elapsed: started.elapsed(),
        relay_kills: crashes,
        injected,
        abandoned: &abandoned,
        inventory: inventory.stats(),
        notifications: notifier.stats(),
        orders_db: &dbs.orders,
        inventory_db: &dbs.inventory,
        notifications_db: &dbs.notifications,
        stock: &stock,
        notes: &notes,
        traffic: &traffic,
        wire: &wire,
        broker: &broker,
    }
    .gather()
    .await?;
    let passed = facts.print();
    if let Err(e) = env::reset_broker(&broker).await {
        println!("\ndemo: the queues stay until the next run: {e:#}");
    }
    println!(
        "\nThe data stays in schema {SCHEMA} of demo_orders, demo_inventory and \
         demo_notifications until the next run."
    );
    Ok(passed)
}

/// Waits until `reached` holds or the clients are done.
async fn reach(driving: &JoinHandle<()>, reached: impl Fn() -> bool) {
    while !reached() && !driving.is_finished() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls `done` until it holds or `limit` passes; returns whether it held.
async fn wait<F, Fut>(limit: Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Crashes the relay while it publishes (right after a message of it
/// arrives), leaves it down for half a second, and starts a new one.
async fn crash_and_restart(
    relay: RunningRelay,
    wire: &Wire,
    pool: &PgPool,
    config: &RelayConfig,
    accepted: usize,
) -> Result<RunningRelay> {
    let _ = tokio::time::timeout(Duration::from_secs(1), wire.activity.notified()).await;
    relay.kill();
    println!("demo: relay CRASHED mid-batch after {accepted} orders; restarting in 0.5 s");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let relay = relay::start(pool, config).await?;
    println!(
        "demo: relay restarted with a backlog of {} events",
        outbox_backlog(pool).await
    );
    Ok(relay)
}

/// Waits (at most [`CATCH_UP`]) until the consumers have settled every
/// delivery: their queues hold nothing ready, each has acked at least
/// `floor` deliveries (every event published and every duplicate
/// injected), and neither acked more since the last look, so none holds
/// a delivery it has yet to settle. Copies the relay published twice are
/// counted by the queues, not by the audit queue: when a node fails
/// under a publish, its queues may each keep or lose their copy.
async fn settle(broker: &Broker, inventory: &Consumer, notifier: &Consumer, floor: u64) {
    let queues = env::unsettled_queues();
    let mut last = None;
    wait(CATCH_UP, || {
        let acked = (inventory.stats().acked(), notifier.stats().acked());
        let steady = last.replace(acked) == Some(acked);
        let queues = &queues;
        async move {
            steady
                && acked.0 >= floor
                && acked.1 >= floor
                && broker.ready(queues).await.ok() == Some(0)
        }
    })
    .await;
}

/// Sends `n` already-published messages again, `copies` times each,
/// straight to both consumers' queues.
async fn inject(broker: &Broker, wire: &Wire, n: usize, copies: usize) -> Result<u64> {
    let samples = wire.take_samples(n);
    let queues = [INVENTORY_QUEUE, NOTIFICATIONS_QUEUE];
    let sent = wire::inject(broker, &samples, &queues, copies)
        .await
        .context("injecting duplicates")?;
    println!(
        "demo: injected {sent} duplicate deliveries into each consumer queue ({} events{})",
        samples.len(),
        if copies > 1 {
            ", twice each, back to back"
        } else {
            ""
        }
    );
    Ok(sent)
}

async fn outbox_backlog(pool: &PgPool) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {SCHEMA}.outbox"
    )))
    .fetch_one(pool)
    .await
    .unwrap_or(-1)
}
