//! The consumer service: supervision (connect, reconnect with backoff),
//! batching deliveries, and settling each committed batch.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::Span;
use tracing::field::Empty;

use crate::ack::{AckItem, Disposition, acknowledge};
use crate::batch::{self, Batch, Verdict};
use crate::config::{ConsumerConfig, Sequencing};
use crate::dedup::Inbox;
use crate::error::{Error, Result, bounded};
use crate::event::{Event, dedup_key};
use crate::handler::{BatchHandler, Handler, Handlers, Outcome};
use crate::sequence::{Deferral, Sequences, position};
use crate::telemetry::{ConsumerStats, Counters};
use crate::topology::declare_retry_queues;
use outbox_core::backoff::Backoff;
use outbox_core::outage::Outage;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

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
    config: ConsumerConfig,
    schema: Ident,
    pool: PgPool,
    handlers: Handlers,
    inbox: Inbox,
    /// The batch transaction's BEGIN with its bounds.
    begin: sqlx::SqlStr,
    /// Sequencing on: the `inbox_sequences` statements.
    sequences: Option<Sequences>,
    counters: Counters,
    broker: Outage,
    database: Outage,
    /// Index of the broker URL the next connection tries first.
    next_url: std::sync::atomic::AtomicUsize,
    /// `host:port` of the broker node in use (or last used).
    node: std::sync::Mutex<Option<String>>,
}

/// Why a broker session ended without error.
enum End {
    Shutdown,
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
        let (broker, database) = (
            Outage::new("broker", config.consumer_name.clone()),
            Outage::new("database", config.consumer_name.clone()),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                begin: config.begin_batch(),
                config,
                schema,
                pool,
                handlers,
                inbox,
                sequences,
                counters: Counters::default(),
                next_url: Default::default(),
                node: Default::default(),
                broker,
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
        let name = me.config.consumer_name.as_str();
        let mut backoff = Backoff::new(FIRST_BACKOFF, me.config.max_reconnect_delay);
        loop {
            match outbox_core::migrate::ensure_migrated(
                &me.pool,
                &crate::migrate::CONSUMER,
                &me.schema,
            )
            .await
            .map_err(outbox::Error::from)
            {
                Ok(()) => break,
                Err(e) if e.is_transient() => {
                    me.database.failed(&Error::Outbox(e));
                    if !pause(&shutdown, &mut backoff).await {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        me.database.ok();
        let mut backoff = Backoff::new(FIRST_BACKOFF, me.config.max_reconnect_delay);
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            match self.session(&shutdown, &mut backoff).await {
                Ok(End::Shutdown) => {
                    tracing::info!(consumer = name, queue = %me.config.queue, "consumer stopped");
                    return Ok(());
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    me.broker.failed(&e);
                    me.counters.broker_errors.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("outbox_consumer_broker_errors_total", "consumer" => name.to_owned())
                        .increment(1);
                    if !pause(&shutdown, &mut backoff).await {
                        return Ok(());
                    }
                }
            }
        }
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

    /// One broker connection, from connect to close.
    async fn session(&self, shutdown: &CancellationToken, backoff: &mut Backoff) -> Result<End> {
        let cfg = &self.inner.config;
        let t = cfg.broker_timeout;
        // lapin's auto-recovery stays off: `run` supervises and reconnects.
        let props = ConnectionProperties::default()
            .with_connection_name(format!("outbox-consumer {}", cfg.consumer_name).into());
        let conn = self.connect(props).await?;
        let result = self.consume(&conn, shutdown, backoff).await;
        // Disconnected: the node's gauge drops to 0 until a connection.
        if let Some(node) = self.broker_node() {
            metrics::gauge!("outbox_consumer_broker_connected", "consumer" => cfg.consumer_name.clone(), "node" => node).set(0.0);
        }
        let _ = tokio::time::timeout(t, conn.close(200, "consumer stopping".into())).await;
        result
    }

    /// Connects to the first broker URL that answers, from the one after
    /// the node used last ([`outbox_core::amqp::connect_any`]).
    async fn connect(&self, props: ConnectionProperties) -> Result<Connection> {
        let me = &self.inner;
        let urls = outbox::redact::split_urls(me.config.amqp_url.expose());
        let start = me.next_url.load(Ordering::Relaxed);
        let (conn, i) =
            outbox_core::amqp::connect_any(&urls, start, me.config.broker_timeout, props).await?;
        me.next_url.store((i + 1) % urls.len(), Ordering::Relaxed);
        let node = outbox::redact::host_port(urls[i]);
        let name = me.config.consumer_name.clone();
        let previous = me
            .node
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(node.clone());
        if let Some(p) = previous.filter(|p| *p != node) {
            metrics::gauge!("outbox_consumer_broker_connected", "consumer" => name.clone(), "node" => p).set(0.0);
        }
        metrics::gauge!("outbox_consumer_broker_connected", "consumer" => name, "node" => node.clone()).set(1.0);
        tracing::info!(consumer = %me.config.consumer_name, broker = %node, "connected to the broker");
        Ok(conn)
    }

    /// `host:port` of the broker node this consumer is connected to, or
    /// was last connected to.
    pub fn broker_node(&self) -> Option<String> {
        self.inner
            .node
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    async fn consume(
        &self,
        conn: &Connection,
        shutdown: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<End> {
        let me = &self.inner;
        let cfg = &me.config;
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
        me.broker.ok();
        me.counters.connections.fetch_add(1, Ordering::Relaxed);
        backoff.reset();
        tracing::info!(consumer = %cfg.consumer_name, queue = %cfg.queue, "consuming");

        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
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
            if let Some(end) = self.process(batch, &publisher, shutdown).await? {
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

    /// Processes one batch: decode, one transaction, republish, ack.
    /// `Some` ends the session.
    async fn process(
        &self,
        mut deliveries: Vec<Delivery>,
        publisher: &Channel,
        shutdown: &CancellationToken,
    ) -> Result<Option<End>> {
        let me = &self.inner;
        let cfg = &me.config;
        let name = cfg.consumer_name.as_str();
        let started = Instant::now();
        // Decode; poison stays in its delivery for the dead-letter copy.
        let mut events = Vec::with_capacity(deliveries.len());
        let mut spans = Vec::with_capacity(deliveries.len());
        let mut positions = Vec::new();
        let ordered = cfg.sequencing.is_on();
        let mut slots: Vec<std::result::Result<usize, (String, Span)>> =
            Vec::with_capacity(deliveries.len());
        for d in &mut deliveries {
            let span = tracing::info_span!(
                "outbox_consumer.event",
                consumer = name,
                event_id = Empty,
                event_type = Empty,
                traceparent = Empty,
                trace_id = Empty,
                parent_span_id = Empty,
                span_id = Empty,
                redelivered = d.redelivered,
                duplicate = Empty,
                outcome = Empty,
            );
            let decoded = dedup_key(&d.properties, &d.data, &cfg.dedup_key).and_then(|id| {
                let at = if ordered {
                    position(&d.properties)?
                } else {
                    None
                };
                Ok((id, at))
            });
            match decoded {
                Ok((id, at)) => {
                    let event = Event {
                        id,
                        properties: std::mem::take(&mut d.properties),
                        payload: std::mem::take(&mut d.data),
                        redelivered: d.redelivered,
                    };
                    span.record("event_id", event.id());
                    if let Some(t) = event.event_type() {
                        span.record("event_type", t);
                    }
                    if let Some(tp) = event.traceparent() {
                        span.record("traceparent", &*tp);
                    }
                    if let Some(t) = event.trace() {
                        span.record("trace_id", t.trace_id.as_str());
                        span.record("parent_span_id", t.parent_span_id.as_deref().unwrap_or(""));
                        span.record("span_id", t.span_id.as_str());
                    }
                    slots.push(Ok(events.len()));
                    events.push(event);
                    if ordered {
                        positions.push(at);
                    }
                    spans.push(span);
                }
                Err(reason) => slots.push(Err((reason, span))),
            }
        }

        let verdicts = if events.is_empty() {
            Vec::new()
        } else {
            let mut backoff = Backoff::new(FIRST_BACKOFF, cfg.max_reconnect_delay);
            let mut failures = 0u32;
            let batch = Batch {
                events: &events,
                spans: &spans,
                positions: &positions,
                handler_timeout: cfg.handler_timeout,
            };
            loop {
                match self.transact(&batch).await {
                    Ok(v) => {
                        me.database.ok();
                        break v;
                    }
                    // Nothing committed, nothing acked: retry the same
                    // deliveries once the database is back.
                    Err(e) if database_unreachable(&e) => {
                        me.database.failed(&Error::Database(e));
                        if !pause(shutdown, &mut backoff).await {
                            return Ok(Some(End::Shutdown));
                        }
                    }
                    // The database answers but this batch fails (a lock
                    // held elsewhere, a deadlock, a constraint): a few
                    // tries, then each event alone; one that still fails
                    // goes through the retry queue, so nothing waits on
                    // this batch for ever.
                    Err(e) => {
                        failures += 1;
                        if failures >= cfg.max_batch_attempts {
                            tracing::warn!(consumer = name, error = %e, attempts = failures, events = events.len(), "batch transaction keeps failing; processing its events one by one");
                            break self.one_by_one(&batch).await;
                        }
                        tracing::warn!(consumer = name, error = %e, attempt = failures, "batch transaction failed; retrying it");
                        if !pause(shutdown, &mut backoff).await {
                            return Ok(Some(End::Shutdown));
                        }
                    }
                }
            }
        };
        let mut counts = [0u64; 6]; // processed, duplicate, retried, rejected, poison, stale
        let mut items = Vec::with_capacity(deliveries.len());
        for (d, slot) in deliveries.iter().zip(&slots) {
            let (action, props, body) = match slot {
                Ok(i) => {
                    let event = &events[*i];
                    let span = &spans[*i];
                    let action = match &verdicts[*i] {
                        Verdict::Duplicate => {
                            span.record("duplicate", true)
                                .record("outcome", "duplicate");
                            counts[1] += 1;
                            Disposition::Ack
                        }
                        Verdict::Stale { seq, last } => {
                            span.record("duplicate", false).record("outcome", "stale");
                            counts[5] += 1;
                            let _enter = span.enter();
                            tracing::debug!(
                                seq,
                                last_seq = last,
                                "stale: at or below the aggregate's last applied sequence number; acked, handler not run"
                            );
                            Disposition::Ack
                        }
                        Verdict::Deferred(deferral) => {
                            span.record("duplicate", false)
                                .record("outcome", "deferred");
                            self.defer(event, deferral, span, &mut counts)
                        }
                        Verdict::Handled(o) => {
                            span.record("duplicate", false).record("outcome", o.label());
                            self.action_for(event, o, span, &mut counts)
                        }
                    };
                    (action, &event.properties, event.payload.as_slice())
                }
                Err((reason, span)) => {
                    span.record("outcome", "poison");
                    counts[4] += 1;
                    let message_id = d.properties.message_id().as_ref().map(|s| s.to_string());
                    tracing::warn!(
                        consumer = name,
                        queue = %cfg.queue,
                        message_id,
                        reason = %reason,
                        "poison message sent to the dead-letter queue"
                    );
                    (
                        Disposition::DeadLetter {
                            reason: format!("poison message: {reason}"),
                        },
                        &d.properties,
                        d.data.as_slice(),
                    )
                }
            };
            items.push(AckItem {
                acker: &d.acker,
                action,
                properties: props,
                body,
            });
        }
        acknowledge(publisher, &cfg.queue, name, &items, cfg.broker_timeout).await?;

        let c = &me.counters;
        for (label, n) in [
            "processed",
            "duplicate",
            "retried",
            "rejected",
            "poison",
            "stale",
        ]
        .into_iter()
        .zip(counts)
        {
            c.events(name, label, n);
        }
        c.batches.fetch_add(1, Ordering::Relaxed);
        metrics::histogram!("outbox_consumer_batch_seconds", "consumer" => name.to_owned())
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("outbox_consumer_batch_size", "consumer" => name.to_owned())
            .record(deliveries.len() as f64);
        Ok(None)
    }

    /// A deferred sequenced event: back to the retry queue on its own
    /// budget (`max_deferrals`, header `x-deferral-count`), its handler
    /// retry count untouched; dead-lettered once the budget is spent.
    fn defer(
        &self,
        event: &Event,
        deferral: &Deferral,
        span: &Span,
        counts: &mut [u64; 6],
    ) -> Disposition {
        let cfg = &self.inner.config;
        let _enter = span.enter();
        let n = event.deferral_count().saturating_add(1);
        if n > cfg.max_deferrals {
            counts[3] += 1;
            let reason = deferral.give_up_reason(cfg.max_deferrals);
            tracing::warn!(reason = %reason, deferrals = cfg.max_deferrals, "sequence gap never closed; sent to the dead-letter queue");
            Disposition::DeadLetter { reason }
        } else {
            counts[2] += 1;
            let delay = cfg.retry_backoff(n);
            tracing::debug!(reason = %deferral.reason(), deferral = n, delay_ms = delay.as_millis() as u64, "deferred");
            Disposition::Defer { deferral: n, delay }
        }
    }

    fn action_for(
        &self,
        event: &Event,
        outcome: &Outcome,
        span: &Span,
        counts: &mut [u64; 6],
    ) -> Disposition {
        let cfg = &self.inner.config;
        let _enter = span.enter();
        match outcome {
            Outcome::Ack => {
                counts[0] += 1;
                Disposition::Ack
            }
            Outcome::Retry(reason) => {
                let attempt = event.retry_count().saturating_add(1);
                if attempt > cfg.max_retries {
                    counts[3] += 1;
                    tracing::warn!(reason = %reason, retries = cfg.max_retries, "out of retries; sent to the dead-letter queue");
                    Disposition::DeadLetter {
                        reason: format!("gave up after {} retries: {reason}", cfg.max_retries),
                    }
                } else {
                    counts[2] += 1;
                    let delay = cfg.retry_backoff(attempt);
                    tracing::debug!(reason = %reason, attempt, delay_ms = delay.as_millis() as u64, "retry scheduled");
                    Disposition::Retry { attempt, delay }
                }
            }
            Outcome::Reject(reason) => {
                counts[3] += 1;
                tracing::warn!(reason = %reason, "rejected; sent to the dead-letter queue");
                Disposition::DeadLetter {
                    reason: reason.clone(),
                }
            }
        }
    }
}

fn next_delivery(d: Option<lapin::Result<Delivery>>, queue: &str) -> Result<Delivery> {
    match d {
        Some(Ok(d)) => Ok(d),
        Some(Err(source)) => Err(Error::Broker {
            what: "consume",
            source,
        }),
        None => Err(Error::ConsumerCancelled {
            queue: queue.to_owned(),
        }),
    }
}

impl Consumer {
    /// `batch` in one transaction, committed (see [`batch::process`]).
    async fn transact(&self, batch: &Batch<'_>) -> sqlx::Result<Vec<Verdict>> {
        let me = &self.inner;
        let sequences = me.sequences.as_ref();
        batch::process(
            &me.pool,
            &me.begin,
            &me.inbox,
            sequences,
            &me.handlers,
            batch,
        )
        .await
    }

    /// Each event of `batch` in a transaction of its own, in delivery
    /// order (so sequenced events keep their order); one whose transaction
    /// fails is retried through the retry queue.
    async fn one_by_one(&self, batch: &Batch<'_>) -> Vec<Verdict> {
        let mut verdicts = Vec::with_capacity(batch.events.len());
        for i in 0..batch.events.len() {
            let one = Batch {
                events: &batch.events[i..=i],
                spans: &batch.spans[i..=i],
                positions: batch.positions.get(i..=i).unwrap_or(&[]),
                handler_timeout: batch.handler_timeout,
            };
            verdicts.push(match self.transact(&one).await {
                Ok(mut v) => v.pop().unwrap_or(Verdict::Duplicate),
                Err(e) => Verdict::Handled(Outcome::retry(format!(
                    "its transaction failed, alone and in its batch: {e}"
                ))),
            });
        }
        verdicts
    }
}

/// The database cannot be reached (or is shutting down): wait it out, the
/// batch is not at fault.
fn database_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => true,
        // Class 08 (connection exception); admin_shutdown,
        // crash_shutdown, cannot_connect_now.
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// Sleeps for the backoff's next delay (jittered, so instances that lost
/// the broker together do not all come back at the same instant); false
/// when `shutdown` fired first.
async fn pause(shutdown: &CancellationToken, backoff: &mut Backoff) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(backoff.next_delay()) => true,
    }
}
