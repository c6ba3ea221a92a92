//! A consumer driven by a test: the production batch stages, no broker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::ack::Disposition;
use crate::batch::Verdict;
use crate::config::ConsumerConfig;
use crate::consumer::Consumer;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::handler::{BatchHandler, Handler, Outcome};
use crate::process::{Decided, Incoming, OnOutage, Stopped};
use crate::telemetry::ConsumerStats;

/// What became of one delivered event: what a running consumer would
/// have done with its message once the batch's transaction committed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivered {
    /// The handler returned [`Outcome::Ack`]: its effect committed with
    /// the event's inbox record; the message is acked.
    Applied,
    /// The event id was in the inbox already (applied before, or an
    /// earlier copy in the same batch): acked, the handler not run.
    Duplicate,
    /// Sequencing on: the event's number is at or below its aggregate's
    /// last applied one: acked, the handler not run.
    Stale {
        /// The event's number.
        seq: i64,
        /// The aggregate's last applied number.
        last: i64,
    },
    /// Its effect rolled back; republished to `<queue>.retry` with
    /// `x-retry-count = attempt`, back after `delay`: the handler's
    /// [`Outcome::Retry`], a panic, a timeout, or a transaction that kept
    /// failing (a conflict past its reruns among them).
    Retried {
        /// The retry's number (1 for the first).
        attempt: u32,
        /// Its backoff.
        delay: Duration,
        /// The handler's reason, or what failed.
        reason: String,
    },
    /// Sequencing on: not its aggregate's turn (a gap, or held back behind
    /// a failed earlier event); republished to `<queue>.retry` with
    /// `x-deferral-count = deferral`, back after `delay`.
    Deferred {
        /// The deferral's number (1 for the first).
        deferral: u32,
        /// Its backoff.
        delay: Duration,
        /// Which number its aggregate expects.
        reason: String,
    },
    /// Sent to `<queue>.dlq` with `reason` (header
    /// `x-dead-letter-reason`): the handler's [`Outcome::Reject`], out of
    /// retries or deferrals, or a poison message.
    DeadLettered {
        /// The dead-letter reason.
        reason: String,
    },
}

/// Runs a [`Handler`] (or [`BatchHandler`]) on built events against a
/// real database, through the consumer's own batch code: the inbox
/// claim (dedup), the sequence locks and turns, the handler with its
/// savepoints, timeout and panic guard, the conflict reruns, then each
/// delivery's disposition from its verdict and the retry budgets, and
/// the counters. What it leaves out is the broker's part: no delivery is
/// received, nothing republished or acked; [`Delivered`] says what would
/// have been.
///
/// The configuration is the consumer's own (schema, consumer name,
/// sequencing, retries, dedup key, timeouts); its AMQP URL and queue are
/// not used.
///
/// ```no_run
/// use outbox_consumer::testing::{Delivered, EventBuilder, TestConsumer, TestSchema};
/// use outbox_consumer::{ConsumerConfig, Event, Handler, Outcome, Sequencing};
/// use outbox_consumer::sqlx::PgConnection;
///
/// struct Ledger;
///
/// impl Handler for Ledger {
///     async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
///         match outbox_consumer::sqlx::query("INSERT INTO entries (event) VALUES ($1)")
///             .bind(event.id())
///             .execute(conn)
///             .await
///         {
///             Ok(_) => Outcome::Ack,
///             Err(e) => e.into(),
///         }
///     }
/// }
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let db = TestSchema::create("postgres://postgres@127.0.0.1:5432/test").await?;
/// outbox_consumer::migrate(db.pool(), db.name()).await?;
/// outbox_consumer::sqlx::query("CREATE TABLE entries (event text)").execute(db.pool()).await?;
///
/// let mut config = ConsumerConfig::new("amqp://unused", "ledger.payments", "ledger");
/// config.schema = db.name().to_owned();
/// config.sequencing = Sequencing::by_sequence();
/// let ledger = TestConsumer::new(config, db.pool().clone(), Ledger)?;
///
/// // Dedup: the same event twice applies once.
/// let first = EventBuilder::new("captured").aggregate("payment", "p-1").sequence(1).build();
/// assert_eq!(ledger.deliver(&first).await?, Delivered::Applied);
/// assert_eq!(ledger.deliver(&first).await?, Delivered::Duplicate);
///
/// // Sequencing: 3 before 2 waits for its turn.
/// let second = EventBuilder::new("refunded").aggregate("payment", "p-1").sequence(2).build();
/// let third = EventBuilder::new("closed").aggregate("payment", "p-1").sequence(3).build();
/// assert!(matches!(ledger.deliver(&third).await?, Delivered::Deferred { deferral: 1, .. }));
/// assert_eq!(ledger.deliver_batch(&[second, third]).await?, [Delivered::Applied, Delivered::Applied]);
/// assert_eq!(ledger.stats().processed, 3);
/// db.cleanup().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TestConsumer {
    consumer: Consumer,
    migrated: AtomicBool,
}

impl TestConsumer {
    /// A consumer running `handler` once per fresh event, as
    /// [`Consumer::new`] builds it. Fails on an invalid configuration.
    pub fn new(config: ConsumerConfig, pool: PgPool, handler: impl Handler) -> Result<Self> {
        Ok(Self::of(Consumer::new(config, pool, handler)?))
    }

    /// A consumer running `handler` once per batch, as
    /// [`Consumer::with_batch_handler`] builds it.
    pub fn with_batch_handler(
        config: ConsumerConfig,
        pool: PgPool,
        handler: impl BatchHandler,
    ) -> Result<Self> {
        Ok(Self::of(Consumer::with_batch_handler(
            config, pool, handler,
        )?))
    }

    fn of(consumer: Consumer) -> Self {
        Self {
            consumer,
            migrated: AtomicBool::new(false),
        }
    }

    /// Processes `event` alone, as a batch of one delivery.
    pub async fn deliver(&self, event: &Event) -> Result<Delivered> {
        let mut delivered = self.deliver_batch(std::slice::from_ref(event)).await?;
        Ok(delivered.pop().expect("one delivery, one result"))
    }

    /// Processes `events` as one batch of deliveries, in this order, in
    /// one transaction (copies of one id in a batch: the first runs); one
    /// result per event, in the same order. At most the configuration's
    /// `batch_size` events, as a consumer takes them.
    ///
    /// `Err`: the inbox is not migrated ([`migrate`](crate::migrate)), the
    /// database cannot be reached (a running consumer would wait it out;
    /// a test would hang), or more events than `batch_size`.
    pub async fn deliver_batch(&self, events: &[Event]) -> Result<Vec<Delivered>> {
        let cfg = self.consumer.config();
        if events.len() > cfg.batch_size {
            return Err(Error::Config(format!(
                "a batch holds at most batch_size ({}) deliveries, not {}",
                cfg.batch_size,
                events.len()
            )));
        }
        self.ensure_migrated().await?;
        let started = Instant::now();
        // As the broker hands them over: properties, body, redelivered.
        let mut messages: Vec<_> = events
            .iter()
            .map(|e| (e.properties.clone(), e.payload.clone(), e.redelivered))
            .collect();
        let pipeline = self.consumer.pipeline();
        let decoded = pipeline.decode(messages.iter_mut().map(|(p, d, r)| Incoming {
            properties: p,
            data: d,
            redelivered: *r,
        }));
        let decided = match pipeline.decide(decoded, OnOutage::GiveUp).await {
            Ok(decided) => decided,
            Err(Stopped::Unreachable(e)) => return Err(Error::Database(e)),
            Err(Stopped::Shutdown) => unreachable!("a test's batch has no shutdown"),
        };
        pipeline.record_decided(&decided, started);
        Ok(report(decided))
    }

    /// What this consumer did so far, counted as a running consumer
    /// counts ([`Consumer::stats`]): `deadlock_retries` and
    /// `serialization_retries` show the batches run again after an
    /// [`Outcome::Conflict`].
    pub fn stats(&self) -> ConsumerStats {
        self.consumer.stats()
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        self.consumer.config()
    }

    async fn ensure_migrated(&self) -> Result<()> {
        if !self.migrated.load(Ordering::Relaxed) {
            self.consumer.check_migrated().await?;
            self.migrated.store(true, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Each delivery's fate, from its verdict and disposition.
fn report(decided: Decided) -> Vec<Delivered> {
    let Decided {
        decoded,
        verdicts,
        dispositions,
        ..
    } = decided;
    decoded
        .slots
        .iter()
        .zip(dispositions)
        .map(|(slot, disposition)| {
            let verdict = slot.as_ref().ok().map(|&i| &verdicts[i]);
            match (disposition, verdict) {
                (Disposition::DeadLetter { reason }, _) => Delivered::DeadLettered { reason },
                (Disposition::Ack, Some(Verdict::Duplicate)) => Delivered::Duplicate,
                (Disposition::Ack, Some(&Verdict::Stale { seq, last })) => {
                    Delivered::Stale { seq, last }
                }
                (Disposition::Ack, _) => Delivered::Applied,
                (Disposition::Retry { attempt, delay }, verdict) => Delivered::Retried {
                    attempt,
                    delay,
                    reason: match verdict {
                        Some(Verdict::Handled(Outcome::Retry(reason))) => reason.clone(),
                        Some(Verdict::Handled(Outcome::Conflict(c))) => c.to_string(),
                        _ => String::new(),
                    },
                },
                (Disposition::Defer { deferral, delay }, verdict) => Delivered::Deferred {
                    deferral,
                    delay,
                    reason: match verdict {
                        Some(Verdict::Deferred(d)) => d.reason(),
                        _ => String::new(),
                    },
                },
            }
        })
        .collect()
}
