//! One batch of deliveries, stage by stage: decode (poison stays in its
//! delivery), the batch transaction (`batch.rs`; retried while the
//! database is unreachable, event by event when the batch keeps failing),
//! a disposition per delivery from its verdict and the retry budgets, then
//! the ack stage (`ack.rs`) and the counters. Everything before the ack
//! stage ([`Consumer::decode`], [`Consumer::decide`]) reads no broker
//! type but the message's properties: the test harness (`testing`)
//! drives the same stages with built events.

use std::sync::atomic::Ordering;
use std::time::Instant;

use lapin::message::Delivery;
use lapin::{BasicProperties, Channel};
use tokio_util::sync::CancellationToken;
use tracing::Span;
use tracing::field::Empty;

use crate::ack::{AckItem, Disposition, acknowledge};
use crate::batch::{self, Batch, Failure, Verdict};
use crate::consumer::Consumer;
use crate::error::{Error, Result};
use crate::event::{Event, dedup_key};
use crate::handler::Outcome;
use crate::sequence::{Deferral, Position, position};
use crate::session::{End, FIRST_BACKOFF, pause};
use crate::telemetry::Counters;
use outbox_core::backoff::Backoff;

/// How many times in a row a batch's transaction is run again at once
/// after losing to a concurrent one (a deadlock, a serialization failure)
/// before that counts as an ordinary failure, with backoff: enough for any
/// real contention, a bound on a handler that reports a conflict every
/// time.
const CONFLICT_RERUNS: u32 = 10;

/// What the decode stage reads of one delivery: a lapin delivery's
/// parts, or a built event's (the test harness). An event takes the
/// properties and body; a poison delivery keeps them.
pub(crate) struct Incoming<'a> {
    pub(crate) properties: &'a mut BasicProperties,
    pub(crate) data: &'a mut Vec<u8>,
    pub(crate) redelivered: bool,
}

impl<'a> From<&'a mut Delivery> for Incoming<'a> {
    fn from(d: &'a mut Delivery) -> Self {
        Self {
            properties: &mut d.properties,
            data: &mut d.data,
            redelivered: d.redelivered,
        }
    }
}

/// A delivery that could not be decoded.
pub(crate) struct Poison {
    /// Why (the dead-letter reason, after `poison message: `).
    reason: String,
    span: Span,
    /// Its `message_id`, for the log line.
    message_id: Option<String>,
}

/// A batch's deliveries decoded.
pub(crate) struct Decoded {
    /// Per delivery: the index of its event, or why it is poison.
    pub(crate) slots: Vec<std::result::Result<usize, Poison>>,
    /// Per event, its position when sequencing is on; otherwise empty.
    positions: Vec<Option<Position>>,
    /// One span per event.
    spans: Vec<Span>,
    pub(crate) events: Vec<Event>,
}

/// A decoded batch after its transaction: what each delivery's verdict
/// was and what the ack stage does with it.
pub(crate) struct Decided {
    pub(crate) decoded: Decoded,
    /// Per event (indexed as `decoded.events`).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by `testing`
    pub(crate) verdicts: Vec<Verdict>,
    /// Per delivery, in delivery order.
    pub(crate) dispositions: Vec<Disposition>,
    tally: Tally,
}

/// What the transaction stage does while the database cannot be reached.
pub(crate) enum OnOutage<'a> {
    /// Waits it out, retrying the same batch with backoff until `shutdown`
    /// fires: nothing is acked before its commit (a running consumer).
    WaitOut(&'a CancellationToken),
    /// Gives up at once with the error (the test harness).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by `testing`
    GiveUp,
}

/// Why the transaction stage returned without a committed batch.
#[derive(Debug)]
pub(crate) enum Stopped {
    /// The shutdown token fired while waiting.
    Shutdown,
    /// The database could not be reached ([`OnOutage::GiveUp`]).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by `testing`
    Unreachable(sqlx::Error),
}

/// What became of a batch's deliveries, per outcome of
/// `outbox_consumer_events_total`.
#[derive(Debug, Default)]
struct Tally {
    /// Handler succeeded, effect committed.
    processed: u64,
    /// Already in the inbox: acked without effect.
    duplicates: u64,
    /// To the retry queue: a handler retry or a deferral.
    retried: u64,
    /// Dead-lettered: rejected, out of retries or out of deferrals.
    rejected: u64,
    /// Undecodable: dead-lettered.
    poison: u64,
    /// Sequenced, at or below the aggregate's last applied number: acked
    /// without effect.
    stale: u64,
}

impl Tally {
    /// Adds these counts to `counters` and to the metric.
    fn record(&self, counters: &Counters, consumer: &str) {
        for (label, n) in [
            ("processed", self.processed),
            ("duplicate", self.duplicates),
            ("retried", self.retried),
            ("rejected", self.rejected),
            ("poison", self.poison),
            ("stale", self.stale),
        ] {
            counters.events(consumer, label, n);
        }
    }
}

impl Consumer {
    /// Processes one batch: decode, one transaction, republish, ack.
    /// `Some` ends the session.
    pub(crate) async fn process(
        &self,
        mut deliveries: Vec<Delivery>,
        publisher: &Channel,
        shutdown: &CancellationToken,
    ) -> Result<Option<End>> {
        let cfg = &self.inner.config;
        let started = Instant::now();
        let decoded = self.decode(deliveries.iter_mut().map(Incoming::from));
        // Waiting out outages, only the shutdown ends it without a commit.
        let Ok(decided) = self.decide(decoded, OnOutage::WaitOut(shutdown)).await else {
            return Ok(Some(End::Shutdown));
        };
        let Decided {
            decoded,
            dispositions,
            tally,
            ..
        } = decided;
        let items = ack_items(&deliveries, &decoded, dispositions);
        acknowledge(
            publisher,
            &cfg.queue,
            &cfg.consumer_name,
            &items,
            cfg.broker_timeout,
        )
        .await?;
        self.record(&tally, started, deliveries.len());
        Ok(None)
    }

    /// The stages between decode and ack: the batch's transaction, then
    /// each delivery's disposition from its verdict and the retry budgets.
    pub(crate) async fn decide(
        &self,
        decoded: Decoded,
        on_outage: OnOutage<'_>,
    ) -> std::result::Result<Decided, Stopped> {
        let verdicts = self.commit(&decoded, on_outage).await?;
        let mut tally = Tally::default();
        let dispositions = self.dispositions(&decoded, &verdicts, &mut tally);
        Ok(Decided {
            decoded,
            verdicts,
            dispositions,
            tally,
        })
    }

    /// Counts a batch whose deliveries were acked: `outbox_consumer_*`
    /// and [`ConsumerStats`](crate::ConsumerStats).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by `testing`
    pub(crate) fn record_decided(&self, decided: &Decided, started: Instant) {
        self.record(&decided.tally, started, decided.dispositions.len());
    }

    fn record(&self, tally: &Tally, started: Instant, deliveries: usize) {
        let me = &self.inner;
        let name = me.config.consumer_name.as_str();
        tally.record(&me.counters, name);
        me.counters.batches.fetch_add(1, Ordering::Relaxed);
        metrics::histogram!("outbox_consumer_batch_seconds", "consumer" => name.to_owned())
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("outbox_consumer_batch_size", "consumer" => name.to_owned())
            .record(deliveries as f64);
    }

    /// The decode stage: an event, with its span, per decodable delivery;
    /// poison stays in its delivery for the dead-letter copy.
    pub(crate) fn decode<'a>(
        &self,
        deliveries: impl ExactSizeIterator<Item = Incoming<'a>>,
    ) -> Decoded {
        let cfg = &self.inner.config;
        let name = cfg.consumer_name.as_str();
        let mut events = Vec::with_capacity(deliveries.len());
        let mut spans = Vec::with_capacity(deliveries.len());
        let mut positions = Vec::new();
        let ordered = cfg.sequencing.is_on();
        let mut slots = Vec::with_capacity(deliveries.len());
        for d in deliveries {
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
            let decoded = dedup_key(d.properties, d.data, &cfg.dedup_key).and_then(|id| {
                let at = if ordered {
                    position(d.properties)?
                } else {
                    None
                };
                Ok((id, at))
            });
            match decoded {
                Ok((id, at)) => {
                    let event = Event {
                        id,
                        properties: std::mem::take(d.properties),
                        payload: std::mem::take(d.data),
                        redelivered: d.redelivered,
                    };
                    record_event(&span, &event);
                    slots.push(Ok(events.len()));
                    events.push(event);
                    if ordered {
                        positions.push(at);
                    }
                    spans.push(span);
                }
                Err(reason) => slots.push(Err(Poison {
                    reason,
                    span,
                    message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
                })),
            }
        }
        Decoded {
            slots,
            positions,
            spans,
            events,
        }
    }

    /// The transaction stage: the decoded events in one transaction
    /// ([`batch::process`]), run again at once when it lost to a
    /// concurrent one, retried while the database is unreachable; a batch
    /// that keeps failing goes event by event.
    async fn commit(
        &self,
        decoded: &Decoded,
        on_outage: OnOutage<'_>,
    ) -> std::result::Result<Vec<Verdict>, Stopped> {
        let events = &decoded.events;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let never = CancellationToken::new();
        let shutdown = match on_outage {
            OnOutage::WaitOut(shutdown) => shutdown,
            OnOutage::GiveUp => &never,
        };
        let wait_out = matches!(on_outage, OnOutage::WaitOut(_));
        let me = &self.inner;
        let cfg = &me.config;
        let name = cfg.consumer_name.as_str();
        let mut backoff = Backoff::new(FIRST_BACKOFF, cfg.max_reconnect_delay);
        let mut failures = 0u32;
        let batch = Batch {
            events,
            spans: &decoded.spans,
            positions: &decoded.positions,
            handler_timeout: cfg.handler_timeout,
        };
        loop {
            match self.transact(&batch).await {
                Ok(v) => {
                    me.database.ok();
                    return Ok(v);
                }
                Err(Failure::Database(e)) if database_unreachable(&e) && !wait_out => {
                    return Err(Stopped::Unreachable(e));
                }
                // Nothing committed, nothing acked: retry the same
                // deliveries once the database is back.
                Err(Failure::Database(e)) if database_unreachable(&e) => {
                    me.database.failed(&Error::Database(e));
                    if !pause(shutdown, &mut backoff).await {
                        return Err(Stopped::Shutdown);
                    }
                }
                // The database answers but this batch fails (a lock
                // held elsewhere, a constraint, conflicts past the
                // reruns): a few tries, then each event alone; one that
                // still fails goes through the retry queue, so nothing
                // waits on this batch for ever.
                Err(e) => {
                    failures += 1;
                    if failures >= cfg.max_batch_attempts {
                        tracing::warn!(consumer = name, error = %e, attempts = failures, events = events.len(), "batch transaction keeps failing; processing its events one by one");
                        return Ok(self.one_by_one(&batch).await);
                    }
                    tracing::warn!(consumer = name, error = %e, attempt = failures, "batch transaction failed; retrying it");
                    if !pause(shutdown, &mut backoff).await {
                        return Err(Stopped::Shutdown);
                    }
                }
            }
        }
    }

    /// `batch` in one transaction, committed (see [`batch::process`]).
    /// A transaction that lost to a concurrent one (a deadlock, a
    /// serialization failure) is run again at once, up to
    /// [`CONFLICT_RERUNS`] times, each counted: the loss says nothing
    /// about the batch, and PostgreSQL already made it wait (a deadlock
    /// costs `deadlock_timeout`). Not a handler retry: no event goes to the
    /// retry queue for it, no retry count moves.
    async fn transact(&self, batch: &Batch<'_>) -> Result<Vec<Verdict>, Failure> {
        let me = &self.inner;
        let name = me.config.consumer_name.as_str();
        let mut reruns = 0;
        loop {
            let done = batch::process(
                &me.pool,
                &me.begin,
                &me.inbox,
                me.sequences.as_ref(),
                &me.handlers,
                batch,
            )
            .await;
            match done {
                Err(Failure::Conflict(c)) if reruns < CONFLICT_RERUNS => {
                    reruns += 1;
                    me.counters.transaction_retried(name, c);
                    tracing::debug!(consumer = name, conflict = %c, rerun = reruns, events = batch.events.len(), "batch transaction lost to a concurrent one; running it again at once");
                }
                done => return done,
            }
        }
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

    /// The disposition stage: what the ack stage does with each delivery,
    /// in delivery order.
    fn dispositions(
        &self,
        decoded: &Decoded,
        verdicts: &[Verdict],
        tally: &mut Tally,
    ) -> Vec<Disposition> {
        decoded
            .slots
            .iter()
            .map(|slot| match slot {
                Ok(i) => {
                    let (event, span) = (&decoded.events[*i], &decoded.spans[*i]);
                    self.disposition(event, &verdicts[*i], span, tally)
                }
                Err(poison) => self.poison(poison, tally),
            })
            .collect()
    }

    /// The disposition of a decoded event, from its verdict.
    fn disposition(
        &self,
        event: &Event,
        verdict: &Verdict,
        span: &Span,
        tally: &mut Tally,
    ) -> Disposition {
        match verdict {
            Verdict::Duplicate => {
                span.record("duplicate", true)
                    .record("outcome", "duplicate");
                tally.duplicates += 1;
                Disposition::Ack
            }
            Verdict::Stale { seq, last } => {
                span.record("duplicate", false).record("outcome", "stale");
                tally.stale += 1;
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
                self.defer(event, deferral, span, tally)
            }
            Verdict::Handled(o) => {
                span.record("duplicate", false).record("outcome", o.label());
                self.outcome_disposition(event, o, span, tally)
            }
        }
    }

    /// A delivery that could not be decoded: to the dead-letter queue.
    fn poison(&self, poison: &Poison, tally: &mut Tally) -> Disposition {
        let cfg = &self.inner.config;
        let name = cfg.consumer_name.as_str();
        let Poison {
            reason,
            span,
            message_id,
        } = poison;
        span.record("outcome", "poison");
        tally.poison += 1;
        tracing::warn!(
            consumer = name,
            queue = %cfg.queue,
            message_id,
            reason = %reason,
            "poison message sent to the dead-letter queue"
        );
        Disposition::DeadLetter {
            reason: format!("poison message: {reason}"),
        }
    }

    /// A deferred sequenced event: back to the retry queue on its own
    /// budget (`max_deferrals`, header `x-deferral-count`), its handler
    /// retry count untouched; dead-lettered once the budget is spent.
    fn defer(
        &self,
        event: &Event,
        deferral: &Deferral,
        span: &Span,
        tally: &mut Tally,
    ) -> Disposition {
        let cfg = &self.inner.config;
        let _enter = span.enter();
        let n = event.deferral_count().saturating_add(1);
        if n > cfg.max_deferrals {
            tally.rejected += 1;
            let reason = deferral.give_up_reason(cfg.max_deferrals);
            tracing::warn!(reason = %reason, deferrals = cfg.max_deferrals, "sequence gap never closed; sent to the dead-letter queue");
            Disposition::DeadLetter { reason }
        } else {
            tally.retried += 1;
            let delay = cfg.retry_backoff(n);
            tracing::debug!(reason = %deferral.reason(), deferral = n, delay_ms = delay.as_millis() as u64, "deferred");
            Disposition::Defer { deferral: n, delay }
        }
    }

    /// The disposition of a handled event: its outcome, within the retry
    /// budget.
    fn outcome_disposition(
        &self,
        event: &Event,
        outcome: &Outcome,
        span: &Span,
        tally: &mut Tally,
    ) -> Disposition {
        let _enter = span.enter();
        match outcome {
            Outcome::Ack => {
                tally.processed += 1;
                Disposition::Ack
            }
            Outcome::Retry(reason) => self.retry(event, reason, tally),
            // Never a verdict (the transaction is run again instead); a
            // retry if it were.
            Outcome::Conflict(c) => self.retry(event, &c.to_string(), tally),
            Outcome::Reject(reason) => {
                tally.rejected += 1;
                tracing::warn!(reason = %reason, "rejected; sent to the dead-letter queue");
                Disposition::DeadLetter {
                    reason: reason.clone(),
                }
            }
        }
    }

    /// A handler's retry: to the retry queue with backoff, or to the
    /// dead-letter queue once `max_retries` are spent.
    fn retry(&self, event: &Event, reason: &str, tally: &mut Tally) -> Disposition {
        let cfg = &self.inner.config;
        let attempt = event.retry_count().saturating_add(1);
        if attempt > cfg.max_retries {
            tally.rejected += 1;
            tracing::warn!(reason = %reason, retries = cfg.max_retries, "out of retries; sent to the dead-letter queue");
            Disposition::DeadLetter {
                reason: format!("gave up after {} retries: {reason}", cfg.max_retries),
            }
        } else {
            tally.retried += 1;
            let delay = cfg.retry_backoff(attempt);
            tracing::debug!(reason = %reason, attempt, delay_ms = delay.as_millis() as u64, "retry scheduled");
            Disposition::Retry { attempt, delay }
        }
    }
}

/// The ack stage's work: each delivery with its disposition and the
/// properties and body of its copy (the event's, or the poison's own).
fn ack_items<'a>(
    deliveries: &'a [Delivery],
    decoded: &'a Decoded,
    dispositions: Vec<Disposition>,
) -> Vec<AckItem<'a>> {
    deliveries
        .iter()
        .zip(&decoded.slots)
        .zip(dispositions)
        .map(|((d, slot), disposition)| {
            let (properties, body) = match slot {
                Ok(i) => {
                    let event = &decoded.events[*i];
                    (&event.properties, event.payload.as_slice())
                }
                Err(_) => (&d.properties, d.data.as_slice()),
            };
            AckItem {
                acker: &d.acker,
                disposition,
                properties,
                body,
            }
        })
        .collect()
}

/// Records a decoded event's identity and trace context on its span.
fn record_event(span: &Span, event: &Event) {
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
