//! Counters (exported through the `metrics` crate as `outbox_consumer_*`
//! and kept in-process for [`ConsumerStats`]) and outage logging.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::handler::Conflict;

/// Counts of what a consumer did since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Fresh events whose handler succeeded: effect committed, then
    /// acked. An effect whose ack was lost (the broker connection went
    /// down between the commit and the ack) is not counted here: its
    /// redelivery finds it in the inbox and counts as a duplicate. For the
    /// exact number of effects, count the consumer's inbox rows.
    pub processed: u64,
    /// Deliveries recognised as duplicates and acked without effect.
    pub duplicates: u64,
    /// Events sent to the retry queue.
    pub retried: u64,
    /// Events dead-lettered: rejected by the handler or out of retries.
    pub rejected: u64,
    /// Poison messages dead-lettered (no dedup key, undecodable body).
    pub poison: u64,
    /// Sequenced events at or below their aggregate's last applied
    /// sequence number, acked without running the handler (ordering on).
    pub stale: u64,
    /// Committed batches.
    pub batches: u64,
    /// Broker sessions started (1 + reconnections).
    pub connections: u64,
    /// Broker sessions that failed (to connect, to declare, to consume, or
    /// mid-stream); each is followed by a backoff and a new attempt.
    pub broker_errors: u64,
    /// Batch transactions run again at once after a deadlock (SQLSTATE
    /// 40P01), raised by a statement or reported by a handler as
    /// [`Outcome::Conflict`](crate::Outcome::Conflict).
    pub deadlock_retries: u64,
    /// Batch transactions run again at once after a serialization failure
    /// (SQLSTATE 40001).
    pub serialization_retries: u64,
}

impl ConsumerStats {
    /// Every delivery acked (after its outcome was made durable).
    pub fn acked(&self) -> u64 {
        self.processed + self.duplicates + self.retried + self.rejected + self.poison + self.stale
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
    poison: AtomicU64,
    stale: AtomicU64,
    batches: AtomicU64,
    connections: AtomicU64,
    broker_errors: AtomicU64,
    deadlock_retries: AtomicU64,
    serialization_retries: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> ConsumerStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            processed: g(&self.processed),
            duplicates: g(&self.duplicates),
            retried: g(&self.retried),
            rejected: g(&self.rejected),
            poison: g(&self.poison),
            stale: g(&self.stale),
            batches: g(&self.batches),
            connections: g(&self.connections),
            broker_errors: g(&self.broker_errors),
            deadlock_retries: g(&self.deadlock_retries),
            serialization_retries: g(&self.serialization_retries),
        }
    }

    /// Counts a batch whose deliveries were acked.
    pub(crate) fn batch(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a broker session that reached consuming.
    pub(crate) fn connection(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a broker session that failed (and
    /// `outbox_consumer_broker_errors_total`).
    pub(crate) fn broker_error(&self, consumer: &str) {
        self.broker_errors.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("outbox_consumer_broker_errors_total", "consumer" => consumer.to_owned())
            .increment(1);
    }

    /// Counts a batch transaction run again after `conflict` (in
    /// `outbox_consumer_transaction_retries_total`, `reason` = deadlock or
    /// serialization).
    pub(crate) fn transaction_retried(&self, consumer: &str, conflict: Conflict) {
        let a = match conflict {
            Conflict::Deadlock => &self.deadlock_retries,
            Conflict::Serialization => &self.serialization_retries,
        };
        a.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("outbox_consumer_transaction_retries_total", "consumer" => consumer.to_owned(), "reason" => conflict.label())
            .increment(1);
    }

    /// Adds `n` events with `outcome` (a label of
    /// `outbox_consumer_events_total`).
    pub(crate) fn events(&self, consumer: &str, outcome: &'static str, n: u64) {
        if n == 0 {
            return;
        }
        let a = match outcome {
            "processed" => &self.processed,
            "duplicate" => &self.duplicates,
            "retried" => &self.retried,
            "rejected" => &self.rejected,
            "stale" => &self.stale,
            _ => &self.poison,
        };
        a.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("outbox_consumer_events_total", "consumer" => consumer.to_owned(), "outcome" => outcome)
            .increment(n);
    }
}
