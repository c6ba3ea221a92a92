//! The disposition stage: what the ack stage does with each delivery,
//! from its verdict and the retry and deferral budgets.

use tracing::Span;

use super::Tally;
use super::decode::{Decoded, Poison};
use crate::ack::Disposition;
use crate::batch::Verdict;
use crate::config::ConsumerConfig;
use crate::event::Event;
use crate::handler::Outcome;
use crate::sequence::Deferral;

/// The disposition stage: what the ack stage does with each delivery, in
/// delivery order.
pub(super) fn dispositions(
    cfg: &ConsumerConfig,
    decoded: &Decoded,
    verdicts: &[Verdict],
    tally: &mut Tally,
) -> Vec<Disposition> {
    Budgets { cfg }.dispositions(decoded, verdicts, tally)
}

/// The retry and deferral budgets of a consumer's configuration.
struct Budgets<'a> {
    cfg: &'a ConsumerConfig,
}

impl Budgets<'_> {
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
        let cfg = self.cfg;
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
        let cfg = self.cfg;
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
        let cfg = self.cfg;
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
