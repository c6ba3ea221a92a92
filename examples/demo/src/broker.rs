//! The demo's own way to the broker (its queues reset and declared, the
//! audit queue read, duplicates injected, what is left counted): every URL
//! it was given, one broker or every node of a cluster, failing over
//! between them as the relay and the consumers do.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

/// Bound on every broker call of the demo's own, connecting to a node
/// included.
pub(crate) const BROKER_TIMEOUT: Duration = Duration::from_secs(5);

/// The broker's URLs and the node that answered last.
#[derive(Debug)]
pub(crate) struct Broker {
    urls: Vec<String>,
    /// The node tried first: the one that answered last.
    current: AtomicUsize,
}

impl Broker {
    /// `amqp_url`: one URL, or several separated by commas.
    pub(crate) fn new(amqp_url: &str) -> Self {
        Self {
            urls: outbox::urls::split_urls(amqp_url)
                .into_iter()
                .map(str::to_owned)
                .collect(),
            current: AtomicUsize::new(0),
        }
    }

    /// A connection to the first node that answers, starting with the
    /// one that answered last.
    pub(crate) async fn connect(&self) -> Result<Connection> {
        let props = ConnectionProperties::default().with_connection_name("demo".into());
        let start = self.current.load(Ordering::Relaxed);
        let (conn, _, i) = outbox_core::amqp::connect_any(&self.urls, start, BROKER_TIMEOUT, props)
            .await
            .context("connecting to RabbitMQ (run `make services`)")?;
        self.current.store(i, Ordering::Relaxed);
        Ok(conn)
    }

    /// Runs `work` on a connection of its own, closed afterwards; once
    /// more on a new connection when it failed (its node may have gone:
    /// `work` must be safe to repeat).
    pub(crate) async fn run<T>(&self, work: impl AsyncFn(&Connection) -> Result<T>) -> Result<T> {
        match self.run_once(&work).await {
            Ok(v) => Ok(v),
            Err(_) => self.run_once(&work).await,
        }
    }

    async fn run_once<T>(&self, work: &impl AsyncFn(&Connection) -> Result<T>) -> Result<T> {
        let conn = self.connect().await?;
        let result = work(&conn).await;
        let _ = tokio::time::timeout(BROKER_TIMEOUT, conn.close(200, "demo".into())).await;
        result
    }

    /// Messages ready in `queues`, together: with no consumer, every
    /// message they hold.
    pub(crate) async fn ready(&self, queues: &[String]) -> Result<u64> {
        self.run(async |conn| {
            let ch = bounded("channel open", conn.create_channel()).await?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let mut n = 0;
            for q in queues {
                let declared = ch.queue_declare(q.as_str().into(), passive, FieldTable::default());
                n += u64::from(bounded("queue.declare", declared).await?.message_count());
            }
            let _ = bounded("channel close", ch.close(200, "counted".into())).await;
            Ok(n)
        })
        .await
    }
}

/// The broker call `what`, bounded by [`BROKER_TIMEOUT`].
pub(crate) async fn bounded<T>(
    what: &'static str,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T> {
    Ok(outbox_core::amqp::bounded(what, BROKER_TIMEOUT, f).await?)
}
