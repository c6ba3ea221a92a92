//! Batches that panic (a relay bug) are quarantined, never retried whole:
//! their events become suspects, published one at a time; one that panics
//! alone is the culprit and is set aside (dead-lettered, or for an ordered
//! event rescheduled with the error, blocking its aggregate for an
//! operator).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox::Ident;
use sqlx::{PgPool, SqlStr};
use uuid::Uuid;

use crate::error::Result;
use crate::message::OutboxEvent;
use crate::mutex::lock;
use outbox_core::backoff::jittered;

/// The quarantine: which events are suspects or culprits, and how to set a
/// culprit aside.
#[derive(Debug)]
pub(crate) struct Quarantine {
    pool: PgPool,
    /// `quarantine/event_seq.sql`.
    event_seq: SqlStr,
    settle: crate::settle::Settle,
    retry_base: Duration,
    retry_max: Duration,
    /// Events of batches during which a worker panicked: each is published
    /// alone until it goes through or is set aside as the culprit.
    suspects: Mutex<HashSet<Uuid>>,
    /// Events that panicked alone, until set aside: never published.
    culprits: Mutex<HashSet<Uuid>>,
    /// Worker panics so far (each one a relay bug).
    panics: AtomicU64,
}

impl Quarantine {
    pub(crate) fn new(
        pool: PgPool,
        schema: &Ident,
        settle: crate::settle::Settle,
        retry_base: Duration,
        retry_max: Duration,
    ) -> Self {
        Self {
            pool,
            event_seq: crate::sql::render(include_str!("quarantine/event_seq.sql"), schema),
            settle,
            retry_base,
            retry_max,
            suspects: Mutex::new(HashSet::new()),
            culprits: Mutex::new(HashSet::new()),
            panics: AtomicU64::new(0),
        }
    }

    /// Worker panics so far.
    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// A batch of `ids` panicked (a relay bug): report it with its event
    /// ids, and make sure that batch is never claimed whole again. Several
    /// events: each becomes a suspect, published alone from now on. One
    /// event alone: it is the culprit; it is dead-lettered (an ordered one
    /// is rescheduled with the error, blocking its aggregate for an
    /// operator, and stays isolated).
    pub(crate) async fn panicked(&self, ids: &[Uuid], why: &str) {
        metrics::counter!("outbox_relay_worker_panics_total").increment(1);
        self.panics.fetch_add(1, Ordering::Relaxed);
        match ids {
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
                    lock(&self.suspects).insert(*id);
                }
                lock(&self.culprits).remove(id);
            }
            // Marked suspects already (`MarkOnPanic`).
            ids => {
                tracing::error!(event_ids = ?ids, panic = %why, "relay bug: a worker panicked on a batch; its events will be published one at a time (please report this)");
            }
        }
    }

    /// Dead-letters an unordered event with `error`; reschedules an ordered
    /// one with it (the relay never dead-letters ordered events) and keeps
    /// it isolated.
    async fn set_aside(&self, id: Uuid, error: &str) -> Result<()> {
        let ordered: Option<Option<i64>> = sqlx::query_scalar(self.event_seq.clone())
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        match ordered {
            None => {}
            Some(None) => {
                self.settle.dead_letter_one(&self.pool, id, error).await?;
                lock(&self.suspects).remove(&id);
            }
            Some(Some(_)) => {
                let delay = jittered(self.retry_base, self.retry_max, 1).as_millis() as i64;
                self.settle
                    .reschedule_one(&self.pool, id, delay, error)
                    .await?;
                lock(&self.suspects).insert(id);
            }
        }
        Ok(())
    }

    /// The batch to publish: `events` as claimed, or, when it holds a
    /// suspect, that suspect alone (for an ordered one, the first event of
    /// its aggregate in the batch, so nothing overtakes it). The rest stay
    /// in the outbox, unlocked at commit.
    pub(crate) fn isolate(&self, mut events: Vec<OutboxEvent>) -> Vec<OutboxEvent> {
        {
            // Events being set aside: not touched (an ordered one holds
            // back the rest of its aggregate in this batch).
            let culprits = lock(&self.culprits);
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
        let suspects = lock(&self.suspects);
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
    pub(crate) fn clear(&self, ids: &[Uuid]) {
        let mut suspects = lock(&self.suspects);
        if !suspects.is_empty() {
            for id in ids {
                suspects.remove(id);
            }
        }
    }

    /// A guard for the batch of `ids`: should a panic unwind through it,
    /// it marks them.
    pub(crate) fn mark_on_panic(&self, ids: Vec<Uuid>) -> MarkOnPanic<'_> {
        MarkOnPanic {
            quarantine: self,
            ids,
        }
    }
}

/// Marks a batch's events when a panic unwinds through the batch: one
/// event alone is the culprit (never published until set aside), several
/// are suspects (each published alone from then on).
pub(crate) struct MarkOnPanic<'a> {
    quarantine: &'a Quarantine,
    ids: Vec<Uuid>,
}

impl Drop for MarkOnPanic<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        match self.ids.as_slice() {
            [id] => {
                lock(&self.quarantine.culprits).insert(*id);
            }
            ids => lock(&self.quarantine.suspects).extend(ids.iter().copied()),
        }
    }
}
