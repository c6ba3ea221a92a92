//! The relay: claim, publish, settle, under a supervisor that owns the
//! broker connection.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use futures_util::FutureExt;
use lapin::Connection;
use outbox::Ident;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::message::{ClaimedEvent, ClaimedRow};
use crate::publish::{self, Publisher, Receipt};
use crate::queries::Queries;
use crate::settle::{Settled, settle};
use crate::wake::{listen, sleep_or_cancel};
use outbox_core::backoff::jittered;
use outbox_core::outage::Outage;

/// One round trip: a transaction whose commit does not wait for the flush,
/// with bounds on every statement and on idling inside it, whatever pool
/// an embedding service hands in (a frozen relay loses its row locks).
///
/// The idle bound is the longest a healthy batch waits inside its
/// transaction (publishing, then the confirms) plus a margin: a relay
/// frozen longer loses its session, its row locks and its partitions'
/// lease locks, so other relays can go on.
fn begin_async_commit(config: &RelayConfig) -> sqlx::SqlStr {
    let idle = publish_phase(config) + std::time::Duration::from_secs(5);
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL statement_timeout = '30s'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
        idle.as_millis()
    )))
}

/// The longest a batch's publish phase may take (exchange checks,
/// publishes and confirms together): within the transaction's idle bound,
/// so the session, its row locks and its lease fence outlive it.
fn publish_phase(config: &RelayConfig) -> std::time::Duration {
    config.confirm_timeout + config.broker_timeout
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// How they were settled.
    pub settled: Settled,
}

/// Liveness and readiness, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    broker: AtomicBool,
    database: AtomicBool,
    /// `host:port` of the broker node in use (or last used).
    node: std::sync::Mutex<Option<String>>,
}

impl Health {
    /// `host:port` of the broker node the relay is connected to, or was
    /// last connected to.
    pub fn broker_node(&self) -> Option<String> {
        lock(&self.node).clone()
    }

    /// Connected to the broker and the last database operation succeeded.
    pub fn is_ready(&self) -> bool {
        self.broker.load(Ordering::Relaxed) && self.database.load(Ordering::Relaxed)
    }
}

/// The relay engine. Embed it in a service or run it with `outbox-relay run`.
///
/// ```no_run
/// # async fn demo() -> anyhow::Result<()> {
/// use outbox_relay::{Relay, RelayConfig};
/// let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/shop").await?;
/// let relay = Relay::new(pool, RelayConfig::default()).await?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// relay.run(shutdown.clone()).await?; // until shutdown is cancelled
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RelayConfig,
    schema: Ident,
    pool: PgPool,
    queries: Queries,
    wake: watch::Sender<u64>,
    health: Arc<Health>,
    broker_outage: Outage,
    db_outage: Outage,
    /// Index of the broker URL the next connection tries first.
    broker_next: std::sync::atomic::AtomicUsize,
    /// Events confirmed by the broker and settled, since start.
    published: std::sync::atomic::AtomicU64,
    /// The broker node last written to `outbox_relays`.
    recorded_node: std::sync::Mutex<Option<String>>,
    /// This relay's identity in `outbox_relays` and `outbox_leases`.
    id: Uuid,
    /// The batch transaction's BEGIN with its settings.
    begin: sqlx::SqlStr,
    /// When the last lease round ran; one worker runs it at a time.
    last_lease_tick: tokio::sync::Mutex<Option<Instant>>,
    /// Partitions held after the last lease round (`usize::MAX`: none yet).
    partitions: AtomicUsize,
    /// Events of batches during which a worker panicked: each is published
    /// alone until it goes through or is set aside as the culprit.
    suspects: std::sync::Mutex<HashSet<Uuid>>,
    /// Events that panicked alone, until set aside: never published.
    culprits: std::sync::Mutex<HashSet<Uuid>>,
    /// Worker panics so far (each one a relay bug).
    panics: std::sync::atomic::AtomicU64,
}

/// An ordered event as claimed, with whether it is due (the chain of an
/// aggregate stops before its first event that is not).
#[derive(sqlx::FromRow)]
struct OrderedRow {
    #[sqlx(flatten)]
    event: ClaimedRow,
    due: bool,
    partition: i32,
}

/// A broker session for [`Relay::run_once`]: one connection, one
/// confirm-mode channel.
pub struct BrokerSession {
    conn: Arc<Connection>,
    publisher: Publisher,
    /// Which share of the relay's partitions this session publishes
    /// (`partition % workers == worker`).
    worker: usize,
    workers: usize,
    /// Per partition, the last aggregate served: the next claim resumes
    /// after it (round robin over aggregates, wrapping at the end).
    cursors: HashMap<i32, (String, String)>,
    /// Expected events per aggregate in a claim (1 to 64): deep aggregates
    /// fill a batch with fewer heads, which costs fewer index descents per
    /// event; one-event aggregates need many heads. Learnt from each claim.
    chain_hint: usize,
    /// The ids of the batch being published (for a panic report).
    in_flight: Vec<Uuid>,
}

impl std::fmt::Debug for BrokerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerSession").finish_non_exhaustive()
    }
}

impl BrokerSession {
    /// Closes the connection (bounded by `timeout`).
    pub async fn close(self, timeout: std::time::Duration) {
        self.publisher.close().await;
        let _ = tokio::time::timeout(timeout, self.conn.close(200, "session closed".into())).await;
    }
}

impl Relay {
    /// Validates `config` and checks the outbox schema is migrated.
    pub async fn new(pool: PgPool, config: RelayConfig) -> Result<Self> {
        let schema = config.validate()?;
        outbox::check_migrated(&pool, schema.as_str()).await?;
        let (wake, _) = watch::channel(0);
        Ok(Self {
            inner: Arc::new(Inner {
                begin: begin_async_commit(&config),
                queries: Queries::new(&schema),
                schema,
                config,
                pool,
                wake,
                health: Arc::new(Health::default()),
                broker_outage: Outage::new("broker", "outbox-relay"),
                broker_next: Default::default(),
                published: Default::default(),
                recorded_node: Default::default(),
                db_outage: Outage::new("database", "outbox-relay"),
                id: Uuid::new_v4(),
                last_lease_tick: tokio::sync::Mutex::new(None),
                partitions: AtomicUsize::new(usize::MAX),
                suspects: std::sync::Mutex::new(HashSet::new()),
                culprits: std::sync::Mutex::new(HashSet::new()),
                panics: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// Readiness, shared with the HTTP endpoints.
    pub fn health(&self) -> Arc<Health> {
        self.inner.health.clone()
    }

    /// Wakes the workers now, as a NOTIFY would. For embedding services
    /// that know they just committed events.
    pub fn wake(&self) {
        self.inner.wake.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Connects to the broker, declaring the default exchange if configured.
    pub async fn connect(&self) -> Result<BrokerSession> {
        let cfg = &self.inner.config;
        let urls = cfg.amqp_urls();
        let start = inner_next(&self.inner);
        let (conn, i) = publish::connect_any(&urls, start, cfg.broker_timeout).await?;
        self.using_node(&urls, i);
        let conn = Arc::new(conn);
        if let Some(kind) = &cfg.declare_exchange {
            publish::declare_exchange(&conn, &cfg.default_exchange, kind, cfg.broker_timeout)
                .await?;
        }
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        Ok(BrokerSession {
            conn,
            publisher,
            worker: 0,
            workers: 1,
            cursors: HashMap::new(),
            chain_hint: 1,
            in_flight: Vec::new(),
        })
    }

    /// This relay's id in `outbox_relays` and `outbox_leases`.
    pub fn id(&self) -> Uuid {
        self.inner.id
    }

    /// One lease round, at most every third of the lease TTL (whichever
    /// worker comes first): heartbeat, renew, rebalance. A failed round is
    /// logged and tried again a round later; leases that lapse meanwhile go
    /// to other relays, which is the point of expiring them.
    async fn lease_round(&self) {
        let inner = &self.inner;
        let cfg = &inner.config;
        let Ok(mut last) = inner.last_lease_tick.try_lock() else {
            return;
        };
        if last.is_some_and(|t| t.elapsed() < cfg.lease_ttl / 3) {
            return;
        }
        let held: sqlx::Result<Vec<i32>> = sqlx::query_scalar(inner.queries.lease_tick.clone())
            .bind(inner.id)
            .bind(&cfg.name)
            .bind(cfg.lease_ttl.as_millis() as i64)
            .fetch_all(&inner.pool)
            .await;
        match held {
            Ok(held) => {
                *last = Some(Instant::now());
                self.record_broker_node().await;
                metrics::gauge!("outbox_relay_partitions_leased").set(held.len() as f64);
                if inner.partitions.swap(held.len(), Ordering::Relaxed) != held.len() {
                    tracing::info!(
                        partitions = held.len(),
                        "ordered-event partitions leased by this relay"
                    );
                }
            }
            Err(e) => {
                // Not at every batch: at the next round's time.
                *last = Some(Instant::now());
                tracing::warn!(error = %e, "lease round failed; retrying at the next round");
            }
        }
    }

    /// Writes the broker node in use to this relay's `outbox_relays` row
    /// (for `outbox-relay status`) when it changed since last written.
    async fn record_broker_node(&self) {
        let inner = &self.inner;
        let node = lock(&inner.health.node).clone();
        if node.is_none() || *lock(&inner.recorded_node) == node {
            return;
        }
        let written = sqlx::query(inner.queries.record_broker.clone())
            .bind(inner.id)
            .bind(node.as_deref())
            .execute(&inner.pool)
            .await;
        match written {
            Ok(_) => *lock(&inner.recorded_node) = node,
            Err(e) => tracing::debug!(error = %e, "could not record the broker node; next round"),
        }
    }

    /// Gives up this relay's leases at once (on shutdown), so survivors do
    /// not wait for them to expire.
    async fn release_leases(&self) {
        let inner = &self.inner;
        if let Err(e) = sqlx::query(inner.queries.lease_release.clone())
            .bind(inner.id)
            .execute(&inner.pool)
            .await
        {
            tracing::warn!(error = %e, "could not release partition leases; they expire by themselves");
        }
    }

    /// Claims one batch, publishes it with pipelined confirms and settles
    /// it, in one database transaction. Events are removed only after their
    /// confirm; on a broker failure the transaction rolls back and the
    /// events stay for the next attempt (not counted against them).
    pub async fn run_once(&self, session: &mut BrokerSession) -> Result<BatchReport> {
        let inner = &self.inner;
        let cfg = &inner.config;
        // `begin` is never raced against a timeout (a cancelled begin can
        // leak an open transaction into the pool); statement_timeout and
        // idle_in_transaction_session_timeout, set in the same round trip,
        // bound the database side.
        //
        // The settle commits without waiting for the WAL flush: losing it
        // in a database crash only means its events are published again,
        // which at-least-once allows and consumers absorb. It keeps the
        // relay's fsyncs off the producers' commit path.
        // Only this batch's ids may be blamed for a panic in it.
        session.in_flight.clear();
        self.lease_round().await;
        let mut tx = inner.pool.begin_with(inner.begin.clone()).await?;
        // Heads per partition: the batch spread over this worker's share of
        // the relay's partitions.
        let held = match inner.partitions.load(Ordering::Relaxed) {
            usize::MAX => 64,
            n => n.max(1),
        };
        let share = held.div_ceil(session.workers).max(1);
        let per_partition = cfg.batch_size.div_ceil(share * session.chain_hint).max(1);
        // Aggregates looked at per partition, due or not: bounds the walk
        // when many heads are backing off.
        let scan_per_partition = (per_partition * 4).max(64);
        let (parts, (types, ids)): (Vec<i32>, (Vec<&str>, Vec<&str>)) = session
            .cursors
            .iter()
            .map(|(p, (t, a))| (*p, (t.as_str(), a.as_str())))
            .unzip();
        let ordered: Vec<OrderedRow> = sqlx::query_as(inner.queries.claim_ordered.clone())
            .bind(inner.id)
            .bind(session.workers as i32)
            .bind(session.worker as i32)
            .bind(per_partition as i32)
            .bind(&parts)
            .bind(&types)
            .bind(&ids)
            .bind(cfg.batch_size as i64)
            .bind(scan_per_partition as i32)
            .fetch_all(&mut *tx)
            .await?;
        let claimed = chains(&ordered);
        advance_cursors(
            &mut session.cursors,
            &claimed,
            per_partition,
            scan_per_partition,
        );
        session.chain_hint = next_chain_hint(session.chain_hint, &claimed, cfg.batch_size);
        let mut events = due_chains(ordered);
        // Unordered events always get a quarter of the batch at least: a
        // large ordered backlog cannot hold them up.
        let room = cfg
            .batch_size
            .saturating_sub(events.len())
            .max(cfg.batch_size.div_ceil(4));
        let unordered: Vec<ClaimedRow> = sqlx::query_as(inner.queries.claim.clone())
            .bind(room as i64)
            .fetch_all(&mut *tx)
            .await?;
        events.extend(unordered.into_iter().map(ClaimedEvent::from));
        if events.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let events = self.isolate_suspect(events);
        if events.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        session.in_flight = events.iter().map(|e| e.id).collect();
        // Declared after `tx`, so dropped before it: should the batch
        // panic, its events are marked before the rollback unlocks them
        // for other workers.
        let on_panic = MarkOnPanic {
            relay: inner,
            ids: session.in_flight.clone(),
        };
        let deadline = tokio::time::Instant::now() + publish_phase(cfg);
        let outcomes = session
            .publisher
            .publish_batch(
                &events,
                &cfg.default_exchange,
                cfg.max_payload_bytes,
                cfg.confirm_timeout,
                deadline,
            )
            .await?;
        let settled = settle(&mut tx, &inner.queries, cfg, &events, &outcomes).await?;
        tx.commit().await?;
        // Settled: a panic from here on is not this batch's.
        drop(on_panic);
        self.clear_suspects(&session.in_flight);
        session.in_flight.clear();
        metrics::histogram!("outbox_relay_batch_size").record(events.len() as f64);
        metrics::counter!("outbox_relay_published_total").increment(settled.delivered as u64);
        self.inner
            .published
            .fetch_add(settled.delivered as u64, Ordering::Relaxed);
        metrics::counter!("outbox_relay_failed_total").increment(settled.retried as u64);
        metrics::counter!("outbox_relay_dead_lettered_total")
            .increment(settled.dead_lettered as u64);
        for (e, o) in events.iter().zip(&outcomes) {
            if let Some(error) = o.error() {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, attempt = e.attempts + 1, error = %error, "event not delivered");
            }
        }
        if outcomes.contains(&Receipt::NotSent) {
            tracing::warn!(
                not_sent = settled.not_sent,
                deadline = ?publish_phase(cfg),
                "the broker was too slow to finish the batch within its publish deadline; the rest goes in the next batch"
            );
        }
        if outcomes.contains(&Receipt::TimedOut) {
            // Confirms may still arrive on this channel; start afresh.
            return Err(Error::BrokerTimeout {
                what: "publisher confirms",
                timeout: cfg.confirm_timeout,
            });
        }
        if let Some(Receipt::ChannelFailed(e)) = outcomes
            .iter()
            .find(|o| matches!(o, Receipt::ChannelFailed(_)))
        {
            // Settled; now replace the closed channel.
            return Err(Error::ChannelClosed(e.clone()));
        }
        if outcomes.contains(&Receipt::Nacked) {
            // Settled (retried later). A channel that published to a
            // quorum queue while its leader changed can go on nacking
            // every publish (seen on RabbitMQ 3.10 after a node was
            // killed) while a fresh channel is acked: replace it. Nacks
            // are otherwise rare (a full queue refusing publishes).
            session.publisher.close().await;
            session.publisher = Publisher::open(&session.conn, cfg.broker_timeout).await?;
        }
        Ok(BatchReport {
            claimed: events.len(),
            settled,
        })
    }

    /// Runs until `shutdown` is cancelled: listens for wake-ups, keeps a
    /// broker connection (reconnecting with backoff), and runs the
    /// configured number of workers. On shutdown, workers stop claiming,
    /// finish the batch in flight (confirm and settle) and return.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut listener = None;
        if cfg.listen {
            listener = Some(tokio::spawn(listen(
                inner.pool.clone(),
                outbox::wakeup_channel(&inner.schema),
                inner.wake.clone(),
                shutdown.clone(),
            )));
        }
        inner.health.database.store(true, Ordering::Relaxed);
        let mut failures = 0u32;
        let mut drained_late = false;
        while !shutdown.is_cancelled() {
            let urls = cfg.amqp_urls();
            let start = inner_next(inner);
            let conn = match publish::connect_any(&urls, start, cfg.broker_timeout).await {
                Ok((c, i)) => {
                    self.using_node(&urls, i);
                    Arc::new(c)
                }
                Err(e) if e.is_refusal() => return self.give_up(e, listener).await,
                Err(e) => {
                    self.broker_down(&e, &mut failures, &shutdown).await;
                    continue;
                }
            };
            if let Some(kind) = &cfg.declare_exchange
                && let Err(e) = publish::declare_exchange(
                    &conn,
                    &cfg.default_exchange,
                    kind,
                    cfg.broker_timeout,
                )
                .await
            {
                if e.is_refusal() {
                    return self.give_up(e, listener).await;
                }
                self.broker_down(&e, &mut failures, &shutdown).await;
                continue;
            }
            let mut workers = JoinSet::new();
            let session_stop = shutdown.child_token();
            for worker in 0..cfg.workers {
                let relay = self.clone();
                let conn = conn.clone();
                let stop = session_stop.clone();
                workers.spawn(async move { relay.work(conn, worker, stop).await });
            }
            let mut broker_error = None;
            let mut worker_bug = false;
            // Once shutdown is asked for, the batches in flight get
            // `drain_timeout` to finish; then they are abandoned (rolled
            // back: their events stay in the outbox).
            let mut drain_by: Option<tokio::time::Instant> = None;
            loop {
                let next = match drain_by {
                    None => tokio::select! {
                        r = workers.join_next() => r,
                        _ = shutdown.cancelled() => {
                            drain_by = Some(tokio::time::Instant::now() + cfg.drain_timeout);
                            continue;
                        }
                    },
                    Some(by) => match tokio::time::timeout_at(by, workers.join_next()).await {
                        Ok(r) => r,
                        Err(_) => {
                            workers.abort_all();
                            while workers.join_next().await.is_some() {}
                            drained_late = true;
                            break;
                        }
                    },
                };
                let Some(r) = next else { break };
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        broker_error.get_or_insert(e);
                        // One worker's broker failure ends the session.
                        session_stop.cancel();
                    }
                    Err(join) => {
                        // Panics inside a batch are caught by the worker;
                        // this is one outside it.
                        let why = match join.try_into_panic() {
                            Ok(panic) => publish::panic_message(&*panic),
                            Err(join) => join.to_string(),
                        };
                        tracing::error!(panic = %why, "relay bug: a worker failed outside a batch; restarting the session (please report this)");
                        metrics::counter!("outbox_relay_worker_panics_total").increment(1);
                        worker_bug = true;
                        session_stop.cancel();
                    }
                }
            }
            // Past the drain timeout nothing more is waited for: the
            // connection is dropped, not closed politely.
            if !drained_late {
                let _ = tokio::time::timeout(
                    cfg.broker_timeout,
                    conn.close(200, "relay session over".into()),
                )
                .await;
            }
            inner.health.broker.store(false, Ordering::Relaxed);
            self.node_gone();
            match broker_error {
                Some(e) if e.is_refusal() => return self.give_up(e, listener).await,
                Some(e) => self.broker_down(&e, &mut failures, &shutdown).await,
                None if worker_bug && !shutdown.is_cancelled() => {
                    failures = failures.saturating_add(1);
                    sleep_or_cancel(
                        jittered(cfg.reconnect_min, cfg.reconnect_max, failures),
                        &shutdown,
                    )
                    .await;
                }
                None => break,
            }
        }
        if let Some(l) = listener {
            l.abort();
        }
        self.release_leases().await;
        if drained_late {
            return Err(Error::DrainTimedOut(cfg.drain_timeout));
        }
        Ok(())
    }

    /// Stops for an error no retry can fix (a refused login, a missing
    /// virtual host, a conflicting declaration): returned from `run`, not
    /// logged as an outage for ever.
    async fn give_up(&self, e: Error, listener: Option<tokio::task::JoinHandle<()>>) -> Result<()> {
        if let Some(l) = listener {
            l.abort();
        }
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.release_leases().await;
        Err(e)
    }

    /// Records (health, metrics, log) that the relay is connected to node
    /// `i` of `urls`; the next reconnect starts with the node after it.
    fn using_node(&self, urls: &[String], i: usize) {
        let node = outbox::redact::host_port(&urls[i]);
        let previous = lock(&self.inner.health.node).replace(node.clone());
        if let Some(p) = previous.filter(|p| *p != node) {
            metrics::gauge!("outbox_relay_broker_connected", "node" => p).set(0.0);
        }
        metrics::gauge!("outbox_relay_broker_connected", "node" => node.clone()).set(1.0);
        self.inner
            .broker_next
            .store((i + 1) % urls.len(), Ordering::Relaxed);
        tracing::info!(broker = %node, "connected to the broker");
    }

    /// The connection to the node in use is gone: its gauge drops to 0.
    fn node_gone(&self) {
        if let Some(node) = lock(&self.inner.health.node).clone() {
            metrics::gauge!("outbox_relay_broker_connected", "node" => node).set(0.0);
        }
    }

    async fn broker_down(&self, e: &Error, failures: &mut u32, shutdown: &CancellationToken) {
        self.inner.health.broker.store(false, Ordering::Relaxed);
        self.inner.broker_outage.failed(e);
        *failures = failures.saturating_add(1);
        let cfg = &self.inner.config;
        sleep_or_cancel(
            jittered(cfg.reconnect_min, cfg.reconnect_max, *failures),
            shutdown,
        )
        .await;
    }

    /// One worker: its own channel, claiming batches until `stop`. Returns
    /// `Err` only for broker failures (the session must be rebuilt).
    async fn work(
        &self,
        conn: Arc<Connection>,
        worker: usize,
        stop: CancellationToken,
    ) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let publisher = Publisher::open(&conn, cfg.broker_timeout).await?;
        let mut session = BrokerSession {
            conn,
            publisher,
            worker,
            workers: cfg.workers,
            cursors: HashMap::new(),
            chain_hint: 1,
            in_flight: Vec::new(),
        };
        inner.health.broker.store(true, Ordering::Relaxed);
        inner.broker_outage.ok();
        let mut wake = inner.wake.subscribe();
        let mut db_failures = 0u32;
        while !stop.is_cancelled() {
            // Mark wake-ups seen *before* claiming: one that arrives during
            // the claim then makes the wait below return at once.
            wake.borrow_and_update();
            let batch = AssertUnwindSafe(self.run_once(&mut session))
                .catch_unwind()
                .await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(panic) => {
                    let why = publish::panic_message(&*panic);
                    drop(panic);
                    self.worker_panicked(&mut session, why).await?;
                    continue;
                }
            };
            match batch {
                Ok(report) => {
                    if db_failures > 0 {
                        inner.db_outage.ok();
                        inner.health.database.store(true, Ordering::Relaxed);
                        db_failures = 0;
                    }
                    if report.claimed > 0 {
                        // More may be due (a full batch, or commits that
                        // landed meanwhile): claim again at once.
                        continue;
                    }
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = wake.changed() => {}
                        _ = tokio::time::sleep(cfg.poll_interval) => {}
                    }
                }
                Err(e) if e.is_broker() || !session.publisher.is_open() => {
                    session.publisher.close().await;
                    return Err(e);
                }
                Err(e) => {
                    inner.health.database.store(false, Ordering::Relaxed);
                    inner.db_outage.failed(&e);
                    db_failures = db_failures.saturating_add(1);
                    sleep_or_cancel(
                        jittered(cfg.reconnect_min, cfg.reconnect_max, db_failures),
                        &stop,
                    )
                    .await;
                }
            }
        }
        // Close the channel before the supervisor closes the connection.
        session.publisher.close().await;
        Ok(())
    }

    /// A batch panicked (a relay bug): report it with its event ids, and
    /// make sure that batch is never claimed whole again. Several events:
    /// each becomes a suspect, published alone from now on. One event
    /// alone: it is the culprit; it is dead-lettered (an ordered one is
    /// rescheduled with the error, blocking its aggregate for an operator,
    /// and stays isolated). The channel may hold half a batch: it is
    /// replaced.
    async fn worker_panicked(&self, session: &mut BrokerSession, why: String) -> Result<()> {
        let inner = &self.inner;
        let ids = std::mem::take(&mut session.in_flight);
        metrics::counter!("outbox_relay_worker_panics_total").increment(1);
        inner.panics.fetch_add(1, Ordering::Relaxed);
        match ids.as_slice() {
            [] => {
                tracing::error!(panic = %why, "relay bug: a worker panicked outside a batch (please report this)")
            }
            [id] => {
                tracing::error!(event_id = %id, panic = %why, "relay bug: a worker panicked publishing this event alone; setting it aside (please report this)");
                let error = format!(
                    "the relay panicked publishing this event (a relay bug; please report it): {why}"
                );
                if let Err(e) = self.set_aside(*id, &error).await {
                    tracing::warn!(event_id = %id, error = %e, "could not set the event aside; it stays isolated");
                    lock(&inner.suspects).insert(*id);
                }
                lock(&inner.culprits).remove(id);
            }
            // Marked suspects already (`MarkOnPanic`).
            ids => {
                tracing::error!(event_ids = ?ids, panic = %why, "relay bug: a worker panicked on a batch; its events will be published one at a time (please report this)");
            }
        }
        session.publisher.close().await;
        session.publisher = Publisher::open(&session.conn, inner.config.broker_timeout).await?;
        Ok(())
    }

    /// Dead-letters an unordered event with `error`; reschedules an ordered
    /// one with it (the relay never dead-letters ordered events) and keeps
    /// it isolated.
    async fn set_aside(&self, id: Uuid, error: &str) -> Result<()> {
        let inner = &self.inner;
        let ordered: Option<Option<i64>> = sqlx::query_scalar(inner.queries.event_seq.clone())
            .bind(id)
            .fetch_optional(&inner.pool)
            .await?;
        match ordered {
            None => {}
            Some(None) => {
                sqlx::query(inner.queries.dead_letter.clone())
                    .bind([id])
                    .bind([error])
                    .execute(&inner.pool)
                    .await?;
                lock(&inner.suspects).remove(&id);
            }
            Some(Some(_)) => {
                let cfg = &inner.config;
                let delay = jittered(cfg.retry_base, cfg.retry_max, 1).as_millis() as i64;
                sqlx::query(inner.queries.reschedule.clone())
                    .bind([id])
                    .bind([delay])
                    .bind([error])
                    .execute(&inner.pool)
                    .await?;
                lock(&inner.suspects).insert(id);
            }
        }
        Ok(())
    }

    /// The batch to publish: `events` as claimed, or, when it holds a
    /// suspect, that suspect alone (for an ordered one, the first event of
    /// its aggregate in the batch, so nothing overtakes it). The rest stay
    /// in the outbox, unlocked at commit.
    fn isolate_suspect(&self, mut events: Vec<ClaimedEvent>) -> Vec<ClaimedEvent> {
        {
            // Events being set aside: not touched (an ordered one holds
            // back the rest of its aggregate in this batch).
            let culprits = lock(&self.inner.culprits);
            if !culprits.is_empty() {
                let mut stopped: HashSet<(String, String)> = HashSet::new();
                events.retain(|e| {
                    let key = (e.aggregate_type.clone(), e.aggregate_id.clone());
                    if culprits.contains(&e.id) {
                        if e.aggregate_seq.is_some() {
                            stopped.insert(key);
                        }
                        return false;
                    }
                    !(e.aggregate_seq.is_some() && stopped.contains(&key))
                });
            }
        }
        let suspects = lock(&self.inner.suspects);
        if suspects.is_empty() {
            return events;
        }
        let Some(i) = events.iter().position(|e| suspects.contains(&e.id)) else {
            return events;
        };
        let first = if events[i].aggregate_seq.is_some() {
            let key = (&events[i].aggregate_type, &events[i].aggregate_id);
            events
                .iter()
                .position(|e| (&e.aggregate_type, &e.aggregate_id) == key)
                .unwrap_or(i)
        } else {
            i
        };
        vec![events.swap_remove(first)]
    }

    /// Events of a batch that went through: no longer suspects.
    fn clear_suspects(&self, ids: &[Uuid]) {
        let mut suspects = lock(&self.inner.suspects);
        if !suspects.is_empty() {
            for id in ids {
                suspects.remove(id);
            }
        }
    }

    /// Events the broker confirmed and the relay settled as delivered
    /// since start (also counted in `outbox_relay_published_total`).
    pub fn published(&self) -> u64 {
        self.inner.published.load(Ordering::Relaxed)
    }

    /// How many times a worker panicked inside a batch (each one a relay
    /// bug, also counted in `outbox_relay_worker_panics_total`).
    pub fn worker_panics(&self) -> u64 {
        self.inner.panics.load(Ordering::Relaxed)
    }

    /// Whether the broker is currently considered down.
    pub fn broker_down_now(&self) -> bool {
        self.inner.broker_outage.is_down()
    }
}

/// Marks a batch's events when a panic unwinds through the batch: one
/// event alone is the culprit (never published until set aside), several
/// are suspects (each published alone from then on).
struct MarkOnPanic<'a> {
    relay: &'a Inner,
    ids: Vec<Uuid>,
}

impl Drop for MarkOnPanic<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        match self.ids.as_slice() {
            [id] => {
                lock(&self.relay.culprits).insert(*id);
            }
            ids => lock(&self.relay.suspects).extend(ids.iter().copied()),
        }
    }
}

/// A mutex's guard, whether or not a panic poisoned it (the sets it guards
/// stay consistent at every await point).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A chain: one aggregate's share of an ordered claim, its head and the
/// consecutive events behind it.
struct Chain<'a> {
    partition: i32,
    key: (&'a str, &'a str),
    /// The head is due (a head backing off comes alone, not due).
    due: bool,
    /// Due events of the chain.
    len: usize,
}

/// The claim's rows grouped by aggregate, in claim order.
fn chains(rows: &[OrderedRow]) -> Vec<Chain<'_>> {
    let mut chains: Vec<Chain<'_>> = Vec::new();
    for r in rows {
        let key = (
            r.event.aggregate_type.as_str(),
            r.event.aggregate_id.as_str(),
        );
        match chains.last_mut() {
            Some(chain) if chain.key == key => chain.len += usize::from(r.due),
            _ => chains.push(Chain {
                partition: r.partition,
                key,
                due: r.due,
                len: usize::from(r.due),
            }),
        }
    }
    chains
}

/// Moves each partition's cursor past the last aggregate looked at, or back
/// to the start when the walk reached the partition's end (fewer than
/// `per_partition` due heads and fewer than `scan` heads in all).
fn advance_cursors(
    cursors: &mut HashMap<i32, (String, String)>,
    chains: &[Chain<'_>],
    per_partition: usize,
    scan: usize,
) {
    // Per partition: heads seen, due heads, last head.
    let mut heads: HashMap<i32, (usize, usize, (&str, &str))> = HashMap::new();
    for chain in chains {
        let entry = heads.entry(chain.partition).or_insert((0, 0, chain.key));
        entry.0 += 1;
        entry.1 += usize::from(chain.due);
        entry.2 = chain.key;
    }
    cursors.clear();
    for (partition, (seen, due, (t, a))) in heads {
        if due >= per_partition || seen >= scan {
            cursors.insert(partition, (t.to_owned(), a.to_owned()));
        }
    }
}

/// The chain length to plan the next claim with: doubled while most due
/// heads filled their chain (their aggregates have more queued), else the
/// average chain seen.
fn next_chain_hint(hint: usize, chains: &[Chain<'_>], batch: usize) -> usize {
    let due: Vec<usize> = chains.iter().filter(|r| r.due).map(|r| r.len).collect();
    if due.is_empty() {
        return hint;
    }
    let heads = due.len();
    let cap = (batch / heads).max(1);
    let full = due.iter().filter(|&&n| n >= cap).count();
    if full * 4 >= heads * 3 {
        (hint * 2).min(64)
    } else {
        due.iter().sum::<usize>().div_ceil(heads).clamp(1, 64)
    }
}

/// The ordered events to publish: each aggregate's chain (head first, in
/// sequence) up to its first event that is not due yet. A head being
/// retried goes alone: the events behind it are not sent again and again
/// while it keeps failing.
fn due_chains(rows: Vec<OrderedRow>) -> Vec<ClaimedEvent> {
    let mut out: Vec<ClaimedEvent> = Vec::with_capacity(rows.len());
    let mut stopped: Option<(String, String)> = None;
    let mut current: Option<(String, String)> = None;
    for OrderedRow { event, due, .. } in rows {
        let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
        if stopped.as_ref() == Some(&key) {
            continue;
        }
        let head = current.as_ref() != Some(&key);
        if !due || (head && event.attempts > 0) {
            if due {
                out.push(event.into());
            }
            stopped = Some(key);
            continue;
        }
        current = Some(key);
        out.push(event.into());
    }
    out
}

/// The broker URL a new connection tries first. After a session, the node
/// after the one just used: a node that failed is not the first one tried
/// again.
fn inner_next(inner: &Inner) -> usize {
    inner.broker_next.load(Ordering::Relaxed)
}
