//! Supervision: broker sessions, one after the other: connect (failing
//! over between the broker URLs), declare, consume batches of deliveries
//! (each processed by the `Pipeline` of `process/`) and, after a failure,
//! reconnect with backoff.

use outbox_core::amqp::BrokerError;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::config::ConsumerConfig;
use crate::error::{Error, Result, bounded};
use crate::pause::{End, FIRST_BACKOFF};
use crate::process::Pipeline;
use crate::telemetry::Counters;
use crate::topology::declare_retry_queues;
use outbox_core::amqp::{BlockWatch, Flow, Link, Nodes};
use outbox_core::backoff::Backoff;
use outbox_core::outage::Outage;

/// The consumer's broker side: its sessions, one after the other.
pub(crate) struct Sessions {
    config: Arc<ConsumerConfig>,
    counters: Arc<Counters>,
    broker: Outage,
    /// The broker's nodes: which one the next connection tries first
    /// (the one in use, or the one after it once a session on it failed),
    /// which one is in use.
    nodes: Nodes,
    /// The broker blocks the session's connection now (a resource alarm):
    /// acks and republishes wait for the lift.
    blocked: Arc<AtomicBool>,
}

impl Sessions {
    pub(crate) fn new(config: Arc<ConsumerConfig>, counters: Arc<Counters>) -> Self {
        let nodes = Nodes::new(
            outbox::urls::split_urls(config.amqp_url.expose())
                .into_iter()
                .map(str::to_owned)
                .collect(),
            config.broker_timeout,
            "outbox_consumer_broker_connected",
            vec![("consumer", config.consumer_name.clone())],
        );
        Self {
            broker: Outage::new("broker", config.consumer_name.clone()),
            config,
            counters,
            nodes,
            blocked: Arc::default(),
        }
    }

    /// `host:port` of the node in use, or last used.
    pub(crate) fn broker_node(&self) -> Option<String> {
        self.nodes.current()
    }

    /// Whether the broker blocks the session's connection now.
    pub(crate) fn blocked_now(&self) -> bool {
        self.blocked.load(Ordering::Relaxed)
    }

    /// Broker sessions until `shutdown`, reconnecting with backoff after
    /// each failure that retrying can fix.
    pub(crate) async fn supervise(
        &self,
        pipeline: &Pipeline,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let name = self.config.consumer_name.as_str();
        let mut backoff = Backoff::new(FIRST_BACKOFF, self.config.max_reconnect_delay);
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            match self.session(pipeline, shutdown, &mut backoff).await {
                Ok(End::Shutdown) => {
                    tracing::info!(consumer = name, queue = %self.config.queue, "consumer stopped");
                    return Ok(());
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    self.broker.failed(&e);
                    self.counters.broker_error(name);
                    if !backoff.pause(shutdown).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// One broker connection, from connect to close.
    async fn session(
        &self,
        pipeline: &Pipeline,
        shutdown: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<End> {
        let cfg = &self.config;
        let t = cfg.broker_timeout;
        // lapin's auto-recovery stays off: `supervise` reconnects.
        let props = ConnectionProperties::default()
            .with_connection_name(format!("outbox-consumer {}", cfg.consumer_name).into());
        let (conn, link, node) = self.connect(props).await?;
        let watch = self.watch_blocks(&conn);
        let result = self.consume(pipeline, &conn, shutdown, backoff).await;
        drop(watch);
        if result.is_err() {
            // The next connection starts with the node after this one.
            self.nodes.leave(node);
        }
        // Disconnected: the node's gauge drops to 0 until a connection.
        self.nodes.gone();
        // Closed before the next one opens, or cut: a blocked connection
        // (a resource alarm) writes nothing, not even its close.
        link.close(&conn, t).await;
        result
    }

    /// Shows the broker's blocks of `conn` (one warning, the gauge,
    /// [`Consumer::broker_blocked_now`](crate::Consumer::broker_blocked_now))
    /// while the watch lives.
    fn watch_blocks(&self, conn: &Connection) -> BlockWatch {
        let blocked = self.blocked.clone();
        let name = self.config.consumer_name.clone();
        metrics::gauge!("outbox_consumer_broker_blocked", "consumer" => name.clone()).set(0.0);
        BlockWatch::new(conn, move |flow| {
            let on = matches!(flow, Flow::Blocked(_));
            blocked.store(on, Ordering::Relaxed);
            metrics::gauge!("outbox_consumer_broker_blocked", "consumer" => name.clone())
                .set(f64::from(u8::from(on)));
            match flow {
                Flow::Blocked(reason) => {
                    tracing::warn!(consumer = %name, %reason, "the broker blocks this connection (a resource alarm): acks and republishes wait for the lift, nothing is charged")
                }
                Flow::Unblocked => tracing::info!(consumer = %name, "the broker lifted its block"),
                Flow::Gone => {}
            }
        })
    }

    /// Connects to the first broker URL that answers, from the node in
    /// use or the one after the node whose session failed
    /// (`outbox_core::amqp::Nodes`, the relay's seam too). Returns the
    /// connection, the link that can cut it, and its node's index.
    async fn connect(&self, props: ConnectionProperties) -> Result<(Connection, Link, usize)> {
        let (conn, link, i) = self.nodes.connect(props).await?;
        let node = self.nodes.current().unwrap_or_default();
        tracing::info!(consumer = %self.config.consumer_name, broker = %node, "connected to the broker");
        Ok((conn, link, i))
    }

    async fn consume(
        &self,
        pipeline: &Pipeline,
        conn: &Connection,
        shutdown: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<End> {
        let cfg = &self.config;
        let t = cfg.broker_timeout;
        let channel = bounded("channel open", t, conn.create_channel()).await?;
        if cfg.declare_retry_queues {
            declare_retry_queues(&channel, &cfg.queue, cfg.queue_type, t).await?;
        }
        bounded(
            "basic.qos",
            t,
            channel.basic_qos(cfg.prefetch, BasicQosOptions::default()),
        )
        .await?;
        let publisher = bounded("channel open", t, conn.create_channel()).await?;
        bounded(
            "confirm.select",
            t,
            publisher.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let tag = format!("{}-{}", cfg.consumer_name, uuid::Uuid::new_v4().simple());
        let mut deliveries = bounded(
            "basic.consume",
            t,
            channel.basic_consume(
                cfg.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        self.broker.ok();
        self.counters.connection();
        backoff.reset();
        tracing::info!(consumer = %cfg.consumer_name, queue = %cfg.queue, "consuming");

        loop {
            let Some(batch) = next_batch(&mut deliveries, cfg, shutdown).await? else {
                break;
            };
            if let Some(end) = pipeline.process(batch, conn, &publisher, shutdown).await? {
                return Ok(end);
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        let _ = bounded(
            "basic.cancel",
            t,
            channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()),
        )
        .await;
        // Channels first: closing a connection under open channels makes
        // lapin log errors on a clean shutdown.
        let _ = bounded("channel close", t, publisher.close(200, "bye".into())).await;
        let _ = bounded("channel close", t, channel.close(200, "bye".into())).await;
        Ok(End::Shutdown)
    }
}

/// Waits for a delivery, then takes more until the batch is full
/// (`batch_size`) or `batch_max_wait` has passed since the first; `None`
/// when `shutdown` fired first.
async fn next_batch(
    deliveries: &mut lapin::Consumer,
    cfg: &ConsumerConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Vec<Delivery>>> {
    let first = tokio::select! {
        biased;
        _ = shutdown.cancelled() => return Ok(None),
        d = deliveries.next() => d,
    };
    let mut batch = vec![next_delivery(first, &cfg.queue)?];
    let deadline = tokio::time::Instant::now() + cfg.batch_max_wait;
    while batch.len() < cfg.batch_size {
        let next = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            d = tokio::time::timeout_at(deadline, deliveries.next()) => d,
        };
        match next {
            Err(_) => break,
            // The connection is going: drop the batch unprocessed,
            // the broker redelivers it.
            Ok(d) => batch.push(next_delivery(d, &cfg.queue)?),
        }
    }
    Ok(Some(batch))
}

fn next_delivery(d: Option<lapin::Result<Delivery>>, queue: &str) -> Result<Delivery> {
    match d {
        Some(Ok(d)) => Ok(d),
        Some(Err(source)) => Err(Error::Broker(BrokerError::Failed {
            what: "consume",
            source,
        })),
        None => Err(Error::ConsumerCancelled {
            queue: queue.to_owned(),
        }),
    }
}
