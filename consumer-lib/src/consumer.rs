//! The consumer's public handle: construction (validating the
//! configuration and building its parts), [`Consumer::run`] and its stats.
//! Its parts are types of their own: `Sessions` (`session.rs`: connect,
//! consume, reconnect) hands each batch of deliveries to the `Pipeline`
//! (`process/`: decode, the transaction stage `Commit`, dispositions, ack).

use std::sync::Arc;

use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::{ConsumerConfig, Sequencing};
use crate::error::{Error, Result};
use crate::handler::{BatchHandler, Handler, Handlers};
use crate::inbox::Inbox;
use crate::pause::FIRST_BACKOFF;
use crate::process::{Commit, Pipeline};
use crate::sequence::Sequences;
use crate::session::Sessions;
use crate::telemetry::{ConsumerStats, Counters};
use outbox_core::backoff::Backoff;
use outbox_core::outage::Outage;

/// Consumes a queue and applies each event's effect exactly once per
/// consumer name: dedup record and effect commit in one transaction, then
/// the message is acked.
///
/// Cheap to clone (clones share state). See the crate docs for an example.
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<ConsumerConfig>,
    schema: Ident,
    pool: PgPool,
    counters: Arc<Counters>,
    /// Shared with the transaction stage.
    database: Arc<Outage>,
    sessions: Sessions,
    pipeline: Pipeline,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.inner.config.queue)
            .field("consumer_name", &self.inner.config.consumer_name)
            .field("schema", &self.inner.schema)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer running `handler` once per fresh event, each event's
    /// effect isolated from the others of its batch. Fails on an invalid
    /// configuration.
    pub fn new(config: ConsumerConfig, pool: PgPool, handler: impl Handler) -> Result<Self> {
        Self::build(config, pool, Handlers::PerEvent(Arc::new(handler)))
    }

    /// A consumer running `handler` once per batch with all its fresh
    /// events, for set-based effects.
    ///
    /// Refuses (with [`Error::Config`]) a configuration with
    /// [`sequencing`](ConsumerConfig::sequencing) on: ordered consumption stops
    /// an aggregate at its first failing event, which a set-based handler
    /// that applies the batch at once cannot honour.
    pub fn with_batch_handler(
        config: ConsumerConfig,
        pool: PgPool,
        handler: impl BatchHandler,
    ) -> Result<Self> {
        Self::build(config, pool, Handlers::Batch(Arc::new(handler)))
    }

    fn build(config: ConsumerConfig, pool: PgPool, handlers: Handlers) -> Result<Self> {
        let schema = config.validate()?;
        let inbox = Inbox::new(&schema, &config.consumer_name);
        let sequences = match config.sequencing {
            Sequencing::Off => None,
            Sequencing::BySequence { accept_first_seen } => {
                if matches!(handlers, Handlers::Batch(_)) {
                    return Err(Error::Config(
                        "ordering needs a per-event Handler: a BatchHandler applies its \
                         events at once and cannot stop an aggregate at its first failing event"
                            .to_owned(),
                    ));
                }
                Some(Sequences::new(
                    &schema,
                    &config.consumer_name,
                    accept_first_seen,
                ))
            }
        };
        let config = Arc::new(config);
        let counters = Arc::new(Counters::default());
        let database = Arc::new(Outage::new("database", config.consumer_name.clone()));
        let commit = Commit::new(
            config.clone(),
            pool.clone(),
            handlers,
            inbox,
            sequences,
            counters.clone(),
            database.clone(),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                sessions: Sessions::new(config.clone(), counters.clone()),
                pipeline: Pipeline::new(config.clone(), counters.clone(), commit),
                config,
                schema,
                pool,
                counters,
                database,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.inner.config
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        self.inner.counters.snapshot()
    }

    /// Consumes until `shutdown` is cancelled.
    ///
    /// Survives broker restarts and connection loss (reconnects with
    /// backoff, one log line per outage) and database outages (the batch in
    /// hand is retried; nothing is acked before its commit). On shutdown it
    /// stops taking deliveries, commits and acks the batch in hand, cancels
    /// the consumer and closes the connection; unacked prefetched messages
    /// go back to the queue.
    ///
    /// Returns an error only when retrying cannot help: the inbox is not
    /// migrated ([`migrate`](crate::migrate)) or newer than this library.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let me = &self.inner;
        if !self.wait_migrated(&shutdown).await? {
            return Ok(());
        }
        // The inbox's day partitions, prepared ahead beside the sessions.
        let upkeep = shutdown.child_token();
        let prepare = crate::retention::prepare_days_hourly(
            me.pool.clone(),
            me.schema.clone(),
            upkeep.clone(),
        );
        let supervised = async {
            let r = me.sessions.supervise(&me.pipeline, &shutdown).await;
            upkeep.cancel();
            r
        };
        tokio::join!(supervised, prepare).0
    }

    #[cfg(feature = "signal")]
    #[cfg_attr(docsrs, doc(cfg(feature = "signal")))]
    /// [`Consumer::run`] until the process receives SIGTERM (what
    /// Kubernetes, systemd and `docker stop` send) or SIGINT (Ctrl-C): then
    /// it stops taking deliveries, commits and acks the batch in hand, and
    /// returns `Ok`, so the service can exit 0.
    ///
    /// ```no_run
    /// # async fn demo(consumer: outbox_consumer::Consumer) -> outbox_consumer::Result<()> {
    /// consumer.run_until_signal().await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_until_signal(&self) -> Result<()> {
        let shutdown = CancellationToken::new();
        let stop = outbox::shutdown_signal(); // handlers installed now
        let signal = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                stop.await;
                shutdown.cancel();
            }
        });
        let result = self.run(shutdown).await;
        signal.abort();
        result
    }

    /// `host:port` of the broker node this consumer is connected to, or
    /// was last connected to.
    pub fn broker_node(&self) -> Option<String> {
        self.inner.sessions.broker_node()
    }

    /// Whether the broker blocks this consumer's connection now (a memory
    /// or disk alarm, which RabbitMQ applies to connections that publish:
    /// this one republishes to its retry and dead-letter queues). Acks and
    /// republishes wait for the lift on the same connection; nothing is
    /// counted against the events. Also the gauge
    /// `outbox_consumer_broker_blocked{consumer}`.
    pub fn broker_blocked_now(&self) -> bool {
        self.inner.sessions.blocked_now()
    }

    /// The batch stages, which the test harness (`testing`) drives with
    /// built events.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by `testing`
    pub(crate) fn pipeline(&self) -> &Pipeline {
        &self.inner.pipeline
    }

    /// `Err` when the inbox is not migrated, or newer than this library.
    pub(crate) async fn check_migrated(&self) -> Result<()> {
        let me = &self.inner;
        outbox_core::migrate::ensure_migrated(&me.pool, &crate::migrate::CONSUMER, &me.schema)
            .await
            .map_err(|e| outbox::Error::from(e).into())
    }

    /// Waits until the inbox is migrated, riding out database outages;
    /// `false` when `shutdown` fired first. `Err`: not migrated, or newer
    /// than this library.
    async fn wait_migrated(&self, shutdown: &CancellationToken) -> Result<bool> {
        let me = &self.inner;
        let mut backoff = Backoff::new(FIRST_BACKOFF, me.config.max_reconnect_delay);
        loop {
            match self.check_migrated().await {
                Ok(()) => break,
                Err(Error::Outbox(e)) if e.is_transient() => {
                    me.database.failed(&Error::Outbox(e));
                    if !backoff.pause(shutdown).await {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        me.database.ok();
        Ok(true)
    }
}
