//! Batches that panic (a relay bug) are quarantined, never retried whole:
//! their events become suspects, published one at a time; one that panics
//! alone is the culprit and is set aside (dead-lettered, or for an ordered
//! event rescheduled with the error, blocking its aggregate for an
//! operator).

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use uuid::Uuid;

use crate::error::Result;
use crate::message::ClaimedEvent;
use crate::publish::Publisher;
use crate::relay::{BrokerSession, Inner, Relay, lock};
use outbox_core::backoff::jittered;

impl Relay {
    /// A batch panicked (a relay bug): report it with its event ids, and
    /// make sure that batch is never claimed whole again. Several events:
    /// each becomes a suspect, published alone from now on. One event
    /// alone: it is the culprit; it is dead-lettered (an ordered one is
    /// rescheduled with the error, blocking its aggregate for an operator,
    /// and stays isolated). The channel may hold half a batch: it is
    /// replaced.
    pub(crate) async fn worker_panicked(
        &self,
        session: &mut BrokerSession,
        why: String,
    ) -> Result<()> {
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
    pub(crate) async fn set_aside(&self, id: Uuid, error: &str) -> Result<()> {
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
    pub(crate) fn isolate_suspect(&self, mut events: Vec<ClaimedEvent>) -> Vec<ClaimedEvent> {
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
    pub(crate) fn clear_suspects(&self, ids: &[Uuid]) {
        let mut suspects = lock(&self.inner.suspects);
        if !suspects.is_empty() {
            for id in ids {
                suspects.remove(id);
            }
        }
    }
}

/// Marks a batch's events when a panic unwinds through the batch: one
/// event alone is the culprit (never published until set aside), several
/// are suspects (each published alone from then on).
pub(crate) struct MarkOnPanic<'a> {
    pub(crate) relay: &'a Inner,
    pub(crate) ids: Vec<Uuid>,
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
