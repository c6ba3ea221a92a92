//! The log's reader: one replication session at a time, supervised like
//! the broker connection (reconnect with backoff, standby while another
//! relay holds the slot), every network wait bounded.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use lapin::Connection;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::WalCapture;
use crate::error::{Error, Result};
use crate::message::ClaimedEvent;
use crate::publish::{Publisher, Receipt};
use crate::relay::{Relay, publish_phase};
use crate::settle::Settled;
use crate::wake::sleep_or_cancel;
use crate::wal::decode::{Unreadable, decode, lsn_text};
use crate::wal::divert;
use outbox_core::backoff::jittered;

/// How a replication session ended, when not by an error.
enum SessionEnd {
    Shutdown,
    /// Another session holds the slot (its `application_name`).
    Standby(String),
}

/// What was read and not yet published.
#[derive(Default)]
struct Pending {
    events: Vec<ClaimedEvent>,
    unreadable: Vec<Unreadable>,
    /// End of the last transaction whose messages are all in `events`: the
    /// position the slot may confirm once they are delivered or recorded.
    commit_end: Option<Lsn>,
    /// That transaction's commit time (µs since 2000-01-01).
    commit_time: Option<i64>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.events.is_empty() && self.unreadable.is_empty()
    }
}

/// Events on the wire at most: this many batches' worth (the raw
/// publisher's best window in the benchmark is of that order).
const WINDOW_BATCHES: usize = 4;
/// Batches on the wire at most (many small ones when events trickle in).
const MAX_BATCHES_ON_WIRE: usize = 64;

/// A batch taken from the stream, sent (all but its queued events).
struct Batch {
    events: Vec<ClaimedEvent>,
    /// Per event: ordered, with its aggregate's events in the outbox
    /// table, so it goes there too instead of being sent.
    queued: Vec<bool>,
    unreadable: Vec<Unreadable>,
    commit_end: Option<Lsn>,
    commit_time: Option<i64>,
}

/// A batch whose confirms are still to come.
struct OnWire {
    batch: Batch,
    /// Its ordered aggregates (type, id).
    ordered: HashSet<(String, String)>,
    /// The receipts of its sent events, in order.
    confirms: BoxFuture<'static, Result<Vec<Receipt>>>,
}

/// The batches on the wire, oldest first: settled in that order, so the
/// slot's position only ever moves past settled batches.
#[derive(Default)]
struct Window {
    batches: VecDeque<OnWire>,
}

impl Window {
    fn len(&self) -> usize {
        self.batches.len()
    }

    fn events(&self) -> usize {
        self.batches.iter().map(|b| b.batch.events.len()).sum()
    }

    fn holds_any(&self, aggregates: &HashSet<(String, String)>) -> bool {
        !aggregates.is_empty()
            && self
                .batches
                .iter()
                .any(|b| !b.ordered.is_disjoint(aggregates))
    }

    fn push(&mut self, b: OnWire) {
        self.batches.push_back(b);
    }

    /// The oldest batch (after its confirms resolved).
    fn pop(&mut self) -> Batch {
        self.batches
            .pop_front()
            .expect("a batch whose confirms resolved is on the wire")
            .batch
    }

    /// The oldest batch's receipts when they are all in already.
    fn ready(&mut self) -> Option<Result<Vec<Receipt>>> {
        self.batches
            .front_mut()
            .and_then(|b| (&mut b.confirms).now_or_never())
    }

    /// Waits for the oldest batch's receipts (for ever when none is on the
    /// wire). Cancel-safe: the confirms stay with their batch.
    async fn oldest_confirms(&mut self) -> Result<Vec<Receipt>> {
        match self.batches.front_mut() {
            Some(b) => (&mut b.confirms).await,
            None => std::future::pending().await,
        }
    }

    /// Confirms `lsn` to the slot once the batches on the wire are settled
    /// (at once when none is).
    fn confirm_after(&mut self, client: &ReplicationClient, acked: &mut Lsn, lsn: Lsn) {
        match self.batches.back_mut() {
            Some(b) => b.batch.commit_end = b.batch.commit_end.max(Some(lsn)),
            None => {
                client.update_applied_lsn(lsn);
                *acked = (*acked).max(lsn);
            }
        }
    }
}

/// The ordered aggregates among `events`.
fn ordered_aggregates(events: &[ClaimedEvent]) -> HashSet<(String, String)> {
    events
        .iter()
        .filter(|e| e.aggregate_seq.is_some())
        .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
        .collect()
}

/// A slot as `pg_replication_slots` shows it.
#[derive(sqlx::FromRow)]
pub(crate) struct SlotRow {
    pub(crate) plugin: Option<String>,
    pub(crate) active: bool,
    /// `application_name` of the session holding it.
    pub(crate) holder: Option<String>,
    pub(crate) wal_status: Option<String>,
    pub(crate) confirmed_flush_lsn: Option<String>,
}

/// `schema`'s slot in this database, if it exists.
pub(crate) async fn slot_row(pool: &PgPool, slot: &str) -> Result<Option<SlotRow>> {
    Ok(sqlx::query_as(
        "SELECT s.plugin::text AS plugin, s.active, a.application_name AS holder, s.wal_status,
                s.confirmed_flush_lsn::text AS confirmed_flush_lsn
         FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
         WHERE s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?)
}

/// What the relay says when its slot was invalidated.
pub(crate) fn lost_message(slot: &str) -> String {
    format!(
        "replication slot {slot:?} was invalidated (wal_status = lost): the relay was away longer than max_slot_wal_keep_size allows and PostgreSQL removed WAL it still needed, so events written meanwhile may be gone from it. Recreate the slot (docs/WAL_CAPTURE.md, \"a lost slot\"), then check the consumers against the producers' records for that period"
    )
}

/// Why the slot cannot be read, if it cannot.
pub(crate) fn refusal(slot: &str, row: Option<&SlotRow>) -> Option<Error> {
    let Some(row) = row else {
        return Some(Error::WalRefused(format!(
            "replication slot {slot:?} does not exist in this database; create it with `outbox-relay migrate --capture wal`"
        )));
    };
    if row.wal_status.as_deref() == Some("lost") {
        return Some(Error::WalRefused(lost_message(slot)));
    }
    if row.plugin.as_deref() != Some("pgoutput") {
        return Some(Error::WalRefused(format!(
            "replication slot {slot:?} uses the plugin {:?}, not pgoutput; drop it and run `outbox-relay migrate --capture wal`",
            row.plugin.as_deref().unwrap_or("?")
        )));
    }
    None
}

fn wal_error(slot: &str, e: PgWireError) -> Error {
    let text = e.to_string();
    match &e {
        PgWireError::Auth(_) => {
            Error::WalRefused(format!("the replication login was refused: {text}"))
        }
        PgWireError::Server(m)
            if m.contains("can no longer get changes") || m.contains("been invalidated") =>
        {
            Error::WalRefused(lost_message(slot))
        }
        PgWireError::Server(m)
            if m.contains("does not exist")
                || m.contains("permission denied")
                || m.contains("must be superuser")
                || m.contains("must have the") =>
        {
            Error::WalRefused(text)
        }
        _ => Error::Replication(text),
    }
}

fn slot_busy(e: &PgWireError) -> bool {
    matches!(e, PgWireError::Server(m) if m.contains("is active for PID"))
}

/// Seconds since the Unix epoch of a PostgreSQL timestamp (µs since
/// 2000-01-01).
fn unix_seconds(pg_micros: i64) -> f64 {
    pg_micros as f64 / 1e6 + 946_684_800.0
}

impl Relay {
    /// Reads the schema's slot until `shutdown`: publishes what it holds,
    /// waits as a standby while another relay reads it, reconnects after
    /// failures. Returns `Err` only for what no retry fixes
    /// ([`Error::WalRefused`], a refused broker login).
    pub(crate) async fn read_wal(&self, shutdown: CancellationToken) -> Result<()> {
        let Some(wal) = self.inner.config.wal.clone() else {
            return Ok(());
        };
        let cfg = &self.inner.config;
        let slot = self.inner.wal_slot.clone();
        let mut failures = 0u32;
        let mut standby: Option<String> = None;
        while !shutdown.is_cancelled() {
            match self
                .wal_session(&wal, &slot, &shutdown, &mut failures)
                .await
            {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Standby(holder)) => {
                    if standby.as_ref() != Some(&holder) {
                        tracing::info!(slot = %slot, holder = %holder, "standby: another session reads the slot; this relay takes over when it is free");
                        standby = Some(holder);
                    }
                    metrics::gauge!("outbox_relay_wal_reading").set(0.0);
                    sleep_or_cancel(wal.standby_poll, &shutdown).await;
                }
                Err(e) if e.is_refusal() => {
                    tracing::error!(slot = %slot, error = %e, "write-ahead-log capture stopped");
                    return Err(e);
                }
                Err(e) => {
                    standby = None;
                    self.inner.wal_outage.failed(&e);
                    failures = failures.saturating_add(1);
                    sleep_or_cancel(
                        jittered(cfg.reconnect_min, cfg.reconnect_max, failures),
                        &shutdown,
                    )
                    .await;
                }
            }
        }
        Ok(())
    }

    /// One replication session: check the slot, connect the broker and
    /// the stream, read until shutdown or a failure.
    async fn wal_session(
        &self,
        wal: &WalCapture,
        slot: &str,
        shutdown: &CancellationToken,
        failures: &mut u32,
    ) -> Result<SessionEnd> {
        let inner = &self.inner;
        let row = slot_row(&inner.pool, slot).await?;
        if let Some(e) = refusal(slot, row.as_ref()) {
            return Err(e);
        }
        let row = row.expect("refusal() checked it exists");
        if row.active {
            return Ok(SessionEnd::Standby(
                row.holder.unwrap_or_else(|| "another session".to_owned()),
            ));
        }
        let confirmed = row
            .confirmed_flush_lsn
            .as_deref()
            .and_then(|l| Lsn::parse(l).ok())
            .unwrap_or(Lsn::ZERO);
        let (conn, node) = self.open_session_on_node().await?;
        let end = self
            .wal_session_on(wal, slot, &conn, confirmed, failures, shutdown)
            .await;
        if end.as_ref().is_err_and(Error::is_broker) {
            // As the table's sessions do: the next connection starts after
            // the node that failed.
            self.leave_node(node);
        }
        end
    }

    /// [`wal_session`](Self::wal_session) on the broker connection `conn`.
    async fn wal_session_on(
        &self,
        wal: &WalCapture,
        slot: &str,
        conn: &Arc<Connection>,
        confirmed: Lsn,
        failures: &mut u32,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut publisher = Publisher::open(conn, cfg.broker_timeout).await?;
        let mut source = crate::wal::source(wal.database_url.expose()).map_err(Error::Config)?;
        source.slot = slot.to_owned();
        source.publication = slot.to_owned().into();
        // Report four times a second, and at least four times per sender
        // timeout, so a live reader is never taken for a dead one.
        let every =
            (wal.sender_timeout / 4).clamp(Duration::from_millis(100), Duration::from_millis(250));
        let source = source
            .with_start_lsn(confirmed)
            .with_ack_lsn(confirmed)
            .with_status_interval(every)
            .with_wakeup_interval(every)
            // Two batches ahead of the reader, beside those on the wire.
            .with_buffer_size((cfg.batch_size * 2).max(256))
            .with_application_name(format!("outbox-relay {}", cfg.name))
            .with_options(format!(
                "-c wal_sender_timeout={}",
                wal.sender_timeout.as_millis()
            ));
        let mut client = ReplicationClient::connect(source)
            .await
            .map_err(|e| wal_error(slot, e))?;
        let started = tokio::time::timeout(cfg.broker_timeout, client.wait_started()).await;
        let mut acked = confirmed;
        let end = match started {
            Ok(Ok(())) => {
                inner.wal_outage.ok();
                *failures = 0;
                metrics::gauge!("outbox_relay_wal_reading").set(1.0);
                tracing::info!(slot = %slot, from = %lsn_text(confirmed.as_u64()), "reading the write-ahead log");
                let end = self
                    .stream(&mut client, &mut publisher, conn, shutdown, &mut acked)
                    .await;
                metrics::gauge!("outbox_relay_wal_reading").set(0.0);
                end
            }
            Ok(Err(e)) if slot_busy(&e) => Ok(SessionEnd::Standby("another session".to_owned())),
            Ok(Err(e)) => Err(wal_error(slot, e)),
            Err(_) => Err(Error::Replication(format!(
                "the server did not start replication within {:?}",
                cfg.broker_timeout
            ))),
        };
        // A clean stop frees the slot at once for a standby.
        if tokio::time::timeout(cfg.broker_timeout, client.shutdown())
            .await
            .is_err()
        {
            client.abort();
        }
        publisher.close().await;
        let _ = tokio::time::timeout(cfg.broker_timeout, conn.close(200, "bye".into())).await;
        if acked > confirmed {
            // The stream's last report may be up to a second old: move the
            // slot to what was confirmed (delivered or recorded), so the
            // next session does not publish it again, whether this one
            // stopped or failed (a confirm timeout ends it just after it
            // recorded the timed-out batch). A standby that took the slot
            // meanwhile refuses this (it then publishes that second again:
            // duplicates only).
            let advance = sqlx::query(
                "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)
                 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
            )
            .bind(slot)
            .bind(lsn_text(acked.as_u64()))
            .execute(&inner.pool);
            if let Ok(Err(e)) = tokio::time::timeout(cfg.broker_timeout, advance).await {
                tracing::debug!(error = %e, "could not advance the slot after the session");
            }
        }
        end
    }

    /// Reads the stream: collects each transaction's events and sends
    /// them when the batch is full or nothing more is ready, without
    /// waiting for the confirms of the batches before (a window of them
    /// stays on the wire); settles the batches in order as their confirms
    /// arrive, confirming each one's position to the slot only then.
    async fn stream(
        &self,
        client: &mut ReplicationClient,
        publisher: &mut Publisher,
        conn: &Arc<Connection>,
        shutdown: &CancellationToken,
        acked: &mut Lsn,
    ) -> Result<SessionEnd> {
        let prefix = outbox::wal_message_prefix(&self.inner.schema);
        let batch = self.inner.config.batch_size;
        let mut pending = Pending::default();
        let mut wire = Window::default();
        let mut in_transaction = false;
        loop {
            if shutdown.is_cancelled() {
                if !pending.is_empty() {
                    self.dispatch(client, publisher, conn, &mut pending, &mut wire, acked)
                        .await?;
                }
                while let Some(b) = wire.batches.pop_front() {
                    let sent = b.confirms.await;
                    self.settle(client, publisher, conn, b.batch, sent, &mut wire, acked)
                        .await?;
                }
                return Ok(SessionEnd::Shutdown);
            }
            let next = if pending.events.len() + pending.unreadable.len() >= batch {
                self.dispatch(client, publisher, conn, &mut pending, &mut wire, acked)
                    .await?;
                continue;
            } else if pending.is_empty() {
                if wire.len() == 0 && !publisher.is_open() {
                    // Nothing to publish, so nothing else would notice a
                    // node that closed the connection (a stopped node):
                    // fail over now, not at the next event (keep-alives
                    // bring the reader here at every status interval).
                    return Err(Error::ChannelClosed(
                        "the broker closed the connection while the log's reader was idle"
                            .to_owned(),
                    ));
                }
                tokio::select! {
                    _ = shutdown.cancelled() => continue,
                    sent = wire.oldest_confirms() => {
                        let b = wire.pop();
                        self.settle(client, publisher, conn, b, sent, &mut wire, acked)
                            .await?;
                        continue;
                    }
                    r = client.recv() => r,
                }
            } else {
                // Only what is ready (one poll, no timer): when nothing is,
                // send what we have.
                match client.recv().now_or_never() {
                    Some(r) => r,
                    None => {
                        self.dispatch(client, publisher, conn, &mut pending, &mut wire, acked)
                            .await?;
                        continue;
                    }
                }
            };
            let event = next
                .map_err(|e| wal_error(&self.inner.wal_slot, e))?
                .ok_or_else(|| Error::Replication("the server ended the stream".to_owned()))?;
            match event {
                ReplicationEvent::Begin { .. } => in_transaction = true,
                ReplicationEvent::Message {
                    transactional,
                    lsn,
                    prefix: p,
                    content,
                } if p == prefix => match decode(&content, transactional, lsn.as_u64(), &prefix) {
                    Ok(e) => pending.events.push(e),
                    Err(u) => {
                        tracing::warn!(lsn = %u.lsn, event_id = %u.id, error = %u.error, "a message of the log is no event: dead-lettered");
                        pending.unreadable.push(u);
                    }
                },
                ReplicationEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => {
                    in_transaction = false;
                    if pending.is_empty() {
                        wire.confirm_after(client, acked, end_lsn);
                    } else {
                        pending.commit_end = Some(end_lsn);
                        pending.commit_time = Some(commit_time_micros);
                    }
                }
                // Everything sent so far is handled once the batches on the
                // wire are: the slot may then move past it (transactions
                // still open commit later).
                ReplicationEvent::KeepAlive { wal_end, .. }
                    if !in_transaction && pending.is_empty() =>
                {
                    wire.confirm_after(client, acked, wal_end);
                }
                _ => {}
            }
        }
    }

    /// Sends the pending events as one batch (those of ordered aggregates
    /// with events in the outbox table go there instead, behind them).
    /// First settles what has its confirms already, and waits for the
    /// oldest batches while the window is full or while one holds an
    /// ordered aggregate of this batch: an ordered aggregate is never in
    /// two batches on the wire, so a failure of its earlier event is in
    /// the table before its later events are looked at.
    async fn dispatch(
        &self,
        client: &ReplicationClient,
        publisher: &mut Publisher,
        conn: &Arc<Connection>,
        pending: &mut Pending,
        wire: &mut Window,
        acked: &mut Lsn,
    ) -> Result<()> {
        let inner = &self.inner;
        let cfg = &inner.config;
        while let Some(sent) = wire.ready() {
            let b = wire.pop();
            self.settle(client, publisher, conn, b, sent, wire, acked)
                .await?;
        }
        let ordered = ordered_aggregates(&pending.events);
        let limit = (cfg.batch_size * WINDOW_BATCHES).max(1);
        while !wire.batches.is_empty()
            && (wire.len() >= MAX_BATCHES_ON_WIRE
                || wire.events() + pending.events.len() > limit
                || wire.holds_any(&ordered))
        {
            let sent = wire.oldest_confirms().await;
            let b = wire.pop();
            self.settle(client, publisher, conn, b, sent, wire, acked)
                .await?;
        }
        if !client.is_running() {
            // The session ended (a frozen relay thawed, say): what is
            // buffered belongs to whoever reads the slot now. Publishing
            // it would only make copies.
            return Err(Error::Replication(
                "the replication session ended".to_owned(),
            ));
        }
        let events = std::mem::take(&mut pending.events);
        let queued = divert::queued_aggregates(&inner.pool, &inner.queries, &events).await?;
        let queued: Vec<bool> = events
            .iter()
            .map(|e| {
                e.aggregate_seq.is_some()
                    && queued.contains(&(e.aggregate_type.clone(), e.aggregate_id.clone()))
            })
            .collect();
        let direct: Vec<ClaimedEvent> = events
            .iter()
            .zip(&queued)
            .filter(|(_, q)| !**q)
            .map(|(e, _)| e.clone())
            .collect();
        let confirms = if direct.is_empty() {
            futures_util::future::ready(Ok(Vec::new())).boxed()
        } else {
            let deadline = tokio::time::Instant::now() + publish_phase(cfg);
            publisher
                .send_batch(
                    &direct,
                    &cfg.default_exchange,
                    cfg.max_payload_bytes,
                    cfg.confirm_timeout,
                    deadline,
                )
                .await?
                .receipts()
                .boxed()
        };
        wire.push(OnWire {
            batch: Batch {
                events,
                queued,
                unreadable: std::mem::take(&mut pending.unreadable),
                commit_end: pending.commit_end.take(),
                commit_time: pending.commit_time.take(),
            },
            ordered,
            confirms,
        });
        Ok(())
    }

    /// Settles the oldest batch of the window with its confirms (`sent`):
    /// records those not delivered in the outbox table, then confirms the
    /// batch's last whole transaction to the slot. A nack replaces the
    /// channel, so the batches still on it are settled first.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        client: &ReplicationClient,
        publisher: &mut Publisher,
        conn: &Arc<Connection>,
        batch: Batch,
        sent: Result<Vec<Receipt>>,
        wire: &mut Window,
        acked: &mut Lsn,
    ) -> Result<()> {
        let mut receipts = self.record(client, batch, sent?, acked).await?;
        if receipts.contains(&Receipt::Nacked) {
            while let Some(b) = wire.batches.pop_front() {
                let sent = b.confirms.await?;
                receipts.extend(self.record(client, b.batch, sent, acked).await?);
            }
        }
        self.after_receipts(publisher, conn, &receipts).await
    }

    /// One batch's receipts: those not delivered go to the outbox table;
    /// then the slot may move past the batch. Returns every event's
    /// receipt.
    async fn record(
        &self,
        client: &ReplicationClient,
        batch: Batch,
        sent: Vec<Receipt>,
        acked: &mut Lsn,
    ) -> Result<Vec<Receipt>> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut sent = sent.into_iter();
        // Queued events were not sent: behind their aggregate's events in
        // the table, untouched (no attempt counted).
        let receipts: Vec<Receipt> = batch
            .queued
            .iter()
            .map(|queued| {
                if *queued {
                    Receipt::NotSent
                } else {
                    sent.next().unwrap_or(Receipt::NotSent)
                }
            })
            .collect();
        let (failed, failed_receipts): (Vec<ClaimedEvent>, Vec<Receipt>) = batch
            .events
            .iter()
            .zip(&receipts)
            .filter(|(_, r)| **r != Receipt::Delivered)
            .map(|(e, r)| (e.clone(), r.clone()))
            .unzip();
        let settled = if failed.is_empty() && batch.unreadable.is_empty() {
            Settled::default()
        } else {
            divert::record(
                &inner.pool,
                &inner.queries,
                cfg,
                &failed,
                &failed_receipts,
                &batch.unreadable,
            )
            .await?
        };
        // Delivered or recorded: the slot may move past them.
        if let Some(lsn) = batch.commit_end {
            client.update_applied_lsn(lsn);
            *acked = (*acked).max(lsn);
        }
        let delivered = batch.events.len() - failed.len();
        self.count_wal(&failed, &failed_receipts, delivered, &settled);
        if let Some(t) = batch.commit_time {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            metrics::histogram!("outbox_relay_wal_delay_seconds")
                .record((now - unix_seconds(t)).max(0.0));
        }
        if !failed.is_empty() {
            // Held-back events are due in the table now.
            self.wake();
        }
        Ok(receipts)
    }

    fn count_wal(
        &self,
        failed: &[ClaimedEvent],
        receipts: &[Receipt],
        delivered: usize,
        settled: &Settled,
    ) {
        metrics::counter!("outbox_relay_wal_published_total").increment(delivered as u64);
        self.add_counts(delivered, settled);
        for (e, r) in failed.iter().zip(receipts) {
            if let Some(error) = r
                .error()
                .filter(|_| !matches!(r, Receipt::NotSent | Receipt::HeldBack))
            {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, error = %error, "event of the log not delivered: it goes to the outbox table to be retried");
            }
        }
    }
}
