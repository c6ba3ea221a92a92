//! Reading the stream: each transaction's events are collected and sent
//! as a batch when it is full or nothing more is ready, without waiting for
//! the confirms of the batches before (a window of them stays on the
//! wire); the batches are finished in order as their confirms arrive, each
//! one's position confirmed to the slot only then.

use outbox_core::amqp::BrokerError;
use std::sync::Arc;

use outbox::Ident;
use sqlx::PgPool;

use futures_util::FutureExt;
use lapin::Connection;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::message::OutboxEvent;
use crate::publish::{Publisher, Receipt};
use crate::settle::Settled;
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use crate::wal::config::ReaderConfig;
use crate::wal::decode::decode;
use crate::wal::divert::Divert;
use crate::wal::slot::{self, wal_error};
use crate::wal::window::{
    Batch, MAX_BATCHES_ON_WIRE, OnWire, Pending, WINDOW_BATCHES, Window, ordered_aggregates,
};

/// How a replication session ended, when not by an error.
pub(super) enum ReadEnd {
    Shutdown,
    /// Another session holds the slot (its `application_name`).
    Standby(String),
}

/// One session's stream and what it holds.
pub(super) struct Session<'a> {
    client: &'a mut ReplicationClient,
    publisher: &'a mut Publisher,
    conn: &'a Arc<Connection>,
    pending: Pending,
    wire: Window,
    /// The position confirmed to the slot so far.
    acked: Lsn,
    in_transaction: bool,
    /// The backend serving this session (`None`: not known yet).
    walsender: Option<i32>,
    /// When the idle reader next checks that the server still serves it.
    check_at: tokio::time::Instant,
}

/// The reader's stream: reading one session's events and finishing its
/// batches (published, or recorded in the table), for
/// [`WalReader`](super::WalReader), which owns it.
pub(super) struct Stream {
    config: ReaderConfig,
    schema: Ident,
    slot: String,
    pool: PgPool,
    divert: Divert,
    stats: Arc<Stats>,
    /// The table workers' wake-up: events diverted to the table are due.
    wakeups: Wakeups,
}

impl Stream {
    /// The stream of `slot` for `schema`; its failed events go to the
    /// table through `divert`.
    pub(super) fn new(
        config: ReaderConfig,
        schema: &Ident,
        slot: &str,
        pool: PgPool,
        divert: Divert,
        stats: Arc<Stats>,
        wakeups: Wakeups,
    ) -> Self {
        Self {
            config,
            schema: schema.clone(),
            slot: slot.to_owned(),
            pool,
            divert,
            stats,
            wakeups,
        }
    }

    /// Reads the stream until shutdown or a failure; `acked` is moved to
    /// the position confirmed to the slot, whatever the end, and
    /// `walsender` to the session's backend once known.
    pub(super) async fn stream(
        &self,
        client: &mut ReplicationClient,
        publisher: &mut Publisher,
        conn: &Arc<Connection>,
        shutdown: &CancellationToken,
        acked: &mut Lsn,
        walsender: &mut Option<i32>,
    ) -> Result<ReadEnd> {
        let mut s = Session {
            client,
            publisher,
            conn,
            pending: Pending::default(),
            wire: Window::default(),
            acked: *acked,
            in_transaction: false,
            walsender: *walsender,
            check_at: tokio::time::Instant::now() + self.config.wal.sender_timeout / 2,
        };
        let end = self.read(&mut s, shutdown).await;
        *acked = s.acked;
        *walsender = s.walsender;
        end
    }

    async fn read(&self, s: &mut Session<'_>, shutdown: &CancellationToken) -> Result<ReadEnd> {
        let prefix = outbox::wal_message_prefix(&self.schema);
        let batch = self.config.batch_size;
        loop {
            if shutdown.is_cancelled() {
                self.drain(s).await?;
                return Ok(ReadEnd::Shutdown);
            }
            let next = if s.pending.events.len() + s.pending.unreadable.len() >= batch {
                self.dispatch(s).await?;
                continue;
            } else if s.pending.is_empty() {
                if s.wire.len() == 0 && !s.publisher.is_open() {
                    // Nothing to publish, so nothing else would notice a
                    // node that closed the connection (a stopped node):
                    // fail over now, not at the next event (keep-alives
                    // bring the reader here at every status interval).
                    return Err(Error::Broker(BrokerError::ChannelClosed(
                        "the broker closed the connection while the log's reader was idle"
                            .to_owned(),
                    )));
                }
                tokio::select! {
                    _ = shutdown.cancelled() => continue,
                    sent = s.wire.oldest_confirms() => {
                        let b = s.wire.pop();
                        self.finish(s, b, sent).await?;
                        continue;
                    }
                    r = s.client.recv() => r,
                    _ = tokio::time::sleep_until(s.check_at) => {
                        self.check_served(s).await?;
                        continue;
                    }
                }
            } else {
                // Only what is ready (one poll, no timer): when nothing is,
                // send what we have.
                match s.client.recv().now_or_never() {
                    Some(r) => r,
                    None => {
                        self.dispatch(s).await?;
                        continue;
                    }
                }
            };
            let event = next
                .map_err(|e| wal_error(&self.slot, e))?
                .ok_or_else(|| Error::Replication("the server ended the stream".to_owned()))?;
            s.take(event, &prefix);
        }
    }

    /// While nothing arrives: whether the server still serves this session.
    /// A replication link that went silent (no RST) would leave the reader
    /// waiting for the kernel to give up, about fifteen minutes; the server
    /// ends its side within the sender timeout (it hears no status from us),
    /// so the slot's holder, asked over a pool connection (bounded by the
    /// database timeout), is no longer our backend. A check that gets no
    /// answer proves nothing and is tried again.
    async fn check_served(&self, s: &mut Session<'_>) -> Result<()> {
        s.check_at = tokio::time::Instant::now() + self.config.wal.sender_timeout / 2;
        match slot::holder_pid(&self.pool, &self.slot, self.config.database_timeout).await {
            Ok(pid) if s.walsender.is_none() => s.walsender = pid,
            Ok(pid) if pid != s.walsender => {
                return Err(Error::Replication(format!(
                    "the server no longer serves this replication session (the slot's holder is {pid:?}, not {:?}): its link went silent",
                    s.walsender
                )));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "could not check the replication session; next time")
            }
        }
        Ok(())
    }

    /// On shutdown: sends what is pending and finishes every batch on the
    /// wire.
    async fn drain(&self, s: &mut Session<'_>) -> Result<()> {
        if !s.pending.is_empty() {
            self.dispatch(s).await?;
        }
        while let Some(b) = s.wire.batches.pop_front() {
            let sent = b.confirms.await;
            self.finish(s, b.batch, sent).await?;
        }
        Ok(())
    }

    /// Sends the pending events as one batch (those of ordered aggregates
    /// with events in the outbox table go there instead, behind them).
    /// First finishes what has its confirms already, and waits for the
    /// oldest batches while the window is full or while one holds an
    /// ordered aggregate of this batch: an ordered aggregate is never in
    /// two batches on the wire, so a failure of its earlier event is in
    /// the table before its later events are looked at.
    async fn dispatch(&self, s: &mut Session<'_>) -> Result<()> {
        while let Some(sent) = s.wire.ready() {
            let b = s.wire.pop();
            self.finish(s, b, sent).await?;
        }
        let ordered = ordered_aggregates(&s.pending.events);
        let limit = (self.config.batch_size * WINDOW_BATCHES).max(1);
        while !s.wire.batches.is_empty()
            && (s.wire.len() >= MAX_BATCHES_ON_WIRE
                || s.wire.events() + s.pending.events.len() > limit
                || s.wire.holds_any(&ordered))
        {
            let sent = s.wire.oldest_confirms().await;
            let b = s.wire.pop();
            self.finish(s, b, sent).await?;
        }
        if !s.client.is_running() {
            // The session ended (a frozen relay thawed, say): what is
            // buffered belongs to whoever reads the slot now. Publishing
            // it would only make copies.
            return Err(Error::Replication(
                "the replication session ended".to_owned(),
            ));
        }
        let on_wire = self.send(s.publisher, &mut s.pending, ordered).await?;
        s.wire.push(on_wire);
        Ok(())
    }

    /// Takes the pending events as a batch and sends those not queued
    /// behind the outbox table.
    async fn send(
        &self,
        publisher: &mut Publisher,
        pending: &mut Pending,
        ordered: std::collections::HashSet<(String, String)>,
    ) -> Result<OnWire> {
        let cfg = &self.config;
        let events = std::mem::take(&mut pending.events);
        let queued = self.divert.queued_aggregates(&self.pool, &events).await?;
        let queued: Vec<bool> = events
            .iter()
            .map(|e| {
                e.aggregate_seq.is_some()
                    && queued.contains(&(e.aggregate_type.clone(), e.aggregate_id.clone()))
            })
            .collect();
        // Those not queued (all of them, without a copy, when none is).
        let copies: Vec<OutboxEvent>;
        let direct: &[OutboxEvent] = if queued.contains(&true) {
            copies = events
                .iter()
                .zip(&queued)
                .filter(|(_, q)| !**q)
                .map(|(e, _)| e.clone())
                .collect();
            &copies
        } else {
            &events
        };
        let confirms = if direct.is_empty() {
            futures_util::future::ready(Ok(Vec::new())).boxed()
        } else {
            let deadline = tokio::time::Instant::now() + cfg.publish.phase;
            publisher
                .send_batch(
                    direct,
                    &cfg.publish.default_exchange,
                    cfg.publish.max_payload_bytes,
                    cfg.publish.confirm_timeout,
                    deadline,
                )
                .await?
                .receipts()
                .boxed()
        };
        Ok(OnWire {
            batch: Batch {
                events,
                queued,
                unreadable: std::mem::take(&mut pending.unreadable),
                commit_end: pending.commit_end.take(),
                commit_time: pending.commit_time.take(),
            },
            ordered,
            confirms,
        })
    }

    /// Finishes the oldest batch of the window with its confirms (`sent`):
    /// accounts for those not delivered in the outbox table, then confirms
    /// the batch's last whole transaction to the slot. A nack replaces the
    /// channel, so the batches still on it are finished first.
    async fn finish(
        &self,
        s: &mut Session<'_>,
        batch: Batch,
        sent: Result<Vec<Receipt>>,
    ) -> Result<()> {
        let mut receipts = self.account(s, batch, sent?).await?;
        if receipts.contains(&Receipt::Nacked) {
            while let Some(b) = s.wire.batches.pop_front() {
                let sent = b.confirms.await?;
                receipts.extend(self.account(s, b.batch, sent).await?);
            }
        }
        s.publisher
            .after_receipts(s.conn, &receipts, self.config.publish.confirm_timeout)
            .await
    }

    /// One batch's receipts: those not delivered go to the outbox table;
    /// then the slot may move past the batch. Returns every event's
    /// receipt.
    async fn account(
        &self,
        s: &mut Session<'_>,
        batch: Batch,
        sent: Vec<Receipt>,
    ) -> Result<Vec<Receipt>> {
        let mut sent = sent.into_iter();
        // Queued events were not sent: behind their aggregate's events in
        // the table, untouched (no attempt counted).
        let receipts: Vec<Receipt> = batch
            .queued
            .iter()
            .map(|queued| {
                if *queued {
                    Receipt::Queued
                } else {
                    sent.next().unwrap_or(Receipt::NotSent)
                }
            })
            .collect();
        let (failed, failed_receipts): (Vec<OutboxEvent>, Vec<Receipt>) = batch
            .events
            .iter()
            .zip(&receipts)
            .filter(|(_, r)| **r != Receipt::Delivered)
            .map(|(e, r)| (e.clone(), r.clone()))
            .unzip();
        let settled = if failed.is_empty() && batch.unreadable.is_empty() {
            Settled::default()
        } else {
            self.divert
                .record(&self.pool, &failed, &failed_receipts, &batch.unreadable)
                .await?
        };
        // Delivered or recorded: the slot may move past them.
        if let Some(lsn) = batch.commit_end {
            s.client.update_applied_lsn(lsn);
            s.acked = s.acked.max(lsn);
        }
        let delivered = batch.events.len() - failed.len();
        self.count(&failed, &failed_receipts, delivered, &settled);
        if let Some(t) = batch.commit_time {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            metrics::histogram!("outbox_relay_wal_delay_seconds")
                .record((now - unix_seconds(t)).max(0.0));
        }
        if !failed.is_empty() {
            // Held-back events are due in the table now.
            self.wakeups.wake();
        }
        Ok(receipts)
    }

    fn count(
        &self,
        failed: &[OutboxEvent],
        receipts: &[Receipt],
        delivered: usize,
        settled: &Settled,
    ) {
        metrics::counter!("outbox_relay_wal_published_total").increment(delivered as u64);
        self.stats.add(delivered, settled);
        for (e, r) in failed.iter().zip(receipts) {
            if let Some(error) = r
                .error()
                .filter(|_| !matches!(r, Receipt::NotSent | Receipt::HeldBack | Receipt::Queued))
            {
                tracing::warn!(event_id = %e.id, event_type = %e.event_type, error = %error, "event of the log not delivered: it goes to the outbox table to be retried");
            }
        }
    }
}

impl Session<'_> {
    /// One message of the stream: an event (or a message that is no
    /// event) joins the pending batch; a commit marks where the slot may
    /// move once that batch is finished.
    fn take(&mut self, event: ReplicationEvent, prefix: &str) {
        match event {
            ReplicationEvent::Begin { .. } => self.in_transaction = true,
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix: p,
                content,
            } if p == prefix => match decode(&content, transactional, lsn.as_u64(), prefix) {
                Ok(e) => self.pending.events.push(e),
                Err(u) => {
                    tracing::warn!(lsn = %u.lsn, event_id = %u.id, error = %u.error, "a message of the log is no event: dead-lettered");
                    self.pending.unreadable.push(u);
                }
            },
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => {
                self.in_transaction = false;
                if self.pending.is_empty() {
                    self.wire
                        .confirm_after(self.client, &mut self.acked, end_lsn);
                } else {
                    self.pending.commit_end = Some(end_lsn);
                    self.pending.commit_time = Some(commit_time_micros);
                }
            }
            // Everything sent so far is handled once the batches on the
            // wire are: the slot may then move past it (transactions
            // still open commit later).
            ReplicationEvent::KeepAlive { wal_end, .. }
                if !self.in_transaction && self.pending.is_empty() =>
            {
                self.wire
                    .confirm_after(self.client, &mut self.acked, wal_end);
            }
            _ => {}
        }
    }
}

/// Seconds since the Unix epoch of a PostgreSQL timestamp (µs since
/// 2000-01-01).
fn unix_seconds(pg_micros: i64) -> f64 {
    pg_micros as f64 / 1e6 + 946_684_800.0
}
