//! The transaction stage: the decoded events in one transaction, run
//! again at once after losing to a concurrent one, retried with backoff
//! while the database is unreachable, event by event when the batch keeps
//! failing.

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::decode::Decoded;
use crate::batch::{self, Batch, Failure, Verdict};
use crate::config::ConsumerConfig;
use crate::error::{Error, Result};
use crate::handler::{Handlers, Outcome};
use crate::inbox::Inbox;
use crate::pause::FIRST_BACKOFF;
use crate::sequence::Sequences;
use crate::telemetry::Counters;
use outbox_core::backoff::Backoff;
use outbox_core::outage::Outage;

/// How many times in a row a batch's transaction is run again at once
/// after losing to a concurrent one (a deadlock, a serialization failure)
/// before that counts as an ordinary failure, with backoff: enough for any
/// real contention, a bound on a handler that reports a conflict every
/// time.
const CONFLICT_RERUNS: u32 = 10;

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

/// The transaction stage, with what a batch's transaction needs.
pub(crate) struct Commit {
    config: Arc<ConsumerConfig>,
    pool: PgPool,
    /// The batch transaction's BEGIN with its bounds.
    begin: sqlx::SqlStr,
    handlers: Handlers,
    inbox: Inbox,
    /// Sequencing on: the `inbox_sequences` statements.
    sequences: Option<Sequences>,
    counters: Arc<Counters>,
    database: Arc<Outage>,
}

impl Commit {
    pub(crate) fn new(
        config: Arc<ConsumerConfig>,
        pool: PgPool,
        handlers: Handlers,
        inbox: Inbox,
        sequences: Option<Sequences>,
        counters: Arc<Counters>,
        database: Arc<Outage>,
    ) -> Self {
        Self {
            begin: config.begin_batch(),
            config,
            pool,
            handlers,
            inbox,
            sequences,
            counters,
            database,
        }
    }

    /// The transaction stage: the decoded events in one transaction
    /// ([`batch::process`]), run again at once when it lost to a
    /// concurrent one, retried while the database is unreachable; a batch
    /// that keeps failing goes event by event.
    pub(super) async fn commit(
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

        let cfg = &self.config;
        let name = cfg.consumer_name.as_str();
        let mut backoff = Backoff::new(FIRST_BACKOFF, cfg.max_reconnect_delay);
        let mut failures = 0u32;
        let batch = Batch {
            events,
            spans: &decoded.spans,
            positions: &decoded.positions,
            handler_timeout: cfg.handler_timeout,
            statement_bound: cfg.lock_timeout + cfg.database_timeout,
        };
        loop {
            let began = std::time::Instant::now();
            match self.transact(&batch).await {
                Ok(v) => {
                    self.database.ok();
                    return Ok(v);
                }
                Err(Failure::Database(e)) if database_unreachable(&e) && !wait_out => {
                    return Err(Stopped::Unreachable(e));
                }
                // Nothing committed, nothing acked: retry the same
                // deliveries once the database is back.
                Err(Failure::Database(e)) if database_unreachable(&e) => {
                    // Begun before another batch saw the database back:
                    // of the outage that ended (no second warning).
                    self.database.failed_since(began, &Error::Database(e));
                    if !backoff.pause(shutdown).await {
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
                    if !backoff.pause(shutdown).await {
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
        let name = self.config.consumer_name.as_str();
        let mut reruns = 0;
        loop {
            let done = batch::process(
                &self.pool,
                &self.begin,
                &self.inbox,
                self.sequences.as_ref(),
                &self.handlers,
                batch,
            )
            .await;
            match done {
                Err(Failure::Conflict(c)) if reruns < CONFLICT_RERUNS => {
                    reruns += 1;
                    self.counters.transaction_retried(name, c);
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
                statement_bound: batch.statement_bound,
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
