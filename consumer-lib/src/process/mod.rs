//! One batch of deliveries, stage by stage: decode (poison stays in its
//! delivery), the batch transaction (`batch/`; retried while the
//! database is unreachable, event by event when the batch keeps failing),
//! a disposition per delivery from its verdict and the retry budgets, then
//! the ack stage (`ack.rs`) and the counters. Everything before the ack
//! stage ([`Pipeline::decode`], [`Pipeline::decide`]) reads no broker
//! type but the message's properties: the test harness (`testing`)
//! drives the same stages with built events.
//!
//! By stage: `decode.rs` (deliveries to events, or poison), `commit.rs`
//! (the transaction stage, [`Commit`]: reruns, outages, one by one),
//! `disposition.rs` (each delivery's disposition from its verdict); the
//! [`Pipeline`] of this file runs them in order, then the ack stage, and
//! counts.

mod commit;
mod decode;
mod disposition;

use std::sync::Arc;
use std::time::Instant;

use lapin::message::Delivery;
use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use self::decode::Decoded;
use crate::ack::{AckItem, Disposition, acknowledge};
use crate::batch::Verdict;
use crate::config::ConsumerConfig;
use crate::error::Result;
use crate::pause::End;
use crate::telemetry::Counters;

pub(crate) use self::commit::{Commit, OnOutage, Stopped};
pub(crate) use self::decode::Incoming;

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

/// A consumer's batch stages, run in order on each batch of deliveries.
pub(crate) struct Pipeline {
    config: Arc<ConsumerConfig>,
    counters: Arc<Counters>,
    commit: Commit,
}

impl Pipeline {
    pub(crate) fn new(
        config: Arc<ConsumerConfig>,
        counters: Arc<Counters>,
        commit: Commit,
    ) -> Self {
        Self {
            config,
            counters,
            commit,
        }
    }

    /// Processes one batch: decode, one transaction, republish, ack.
    /// `Some` ends the session.
    pub(crate) async fn process(
        &self,
        mut deliveries: Vec<Delivery>,
        conn: &Connection,
        publisher: &Channel,
        shutdown: &CancellationToken,
    ) -> Result<Option<End>> {
        let cfg = &self.config;
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
            conn,
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

    /// The decode stage: an event, with its span, per decodable delivery;
    /// poison stays in its delivery for the dead-letter copy.
    pub(crate) fn decode<'a>(
        &self,
        deliveries: impl ExactSizeIterator<Item = Incoming<'a>>,
    ) -> Decoded {
        decode::decode(&self.config, deliveries)
    }

    /// The stages between decode and ack: the batch's transaction, then
    /// each delivery's disposition from its verdict and the retry budgets.
    pub(crate) async fn decide(
        &self,
        decoded: Decoded,
        on_outage: OnOutage<'_>,
    ) -> std::result::Result<Decided, Stopped> {
        let verdicts = self.commit.commit(&decoded, on_outage).await?;
        let mut tally = Tally::default();
        let dispositions = disposition::dispositions(&self.config, &decoded, &verdicts, &mut tally);
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
        let name = self.config.consumer_name.as_str();
        tally.record(&self.counters, name);
        self.counters.batch();
        metrics::histogram!("outbox_consumer_batch_seconds", "consumer" => name.to_owned())
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("outbox_consumer_batch_size", "consumer" => name.to_owned())
            .record(deliveries as f64);
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
