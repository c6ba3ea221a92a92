//! The reader's window: what was read and not yet sent ([`Pending`]), and
//! the batches on the wire awaiting their confirms ([`Window`]), settled
//! oldest first so the slot only ever moves past settled batches.

use std::collections::{HashSet, VecDeque};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use pgwire_replication::{Lsn, ReplicationClient};

use crate::error::Result;
use crate::message::OutboxEvent;
use crate::publish::Receipt;
use crate::wal::decode::Unreadable;

/// What was read and not yet published.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) events: Vec<OutboxEvent>,
    pub(super) unreadable: Vec<Unreadable>,
    /// End of the last transaction whose messages are all in `events`: the
    /// position the slot may confirm once they are delivered or recorded.
    pub(super) commit_end: Option<Lsn>,
    /// That transaction's commit time (µs since 2000-01-01).
    pub(super) commit_time: Option<i64>,
}

impl Pending {
    pub(super) fn is_empty(&self) -> bool {
        self.events.is_empty() && self.unreadable.is_empty()
    }
}

/// Events on the wire at most: this many batches' worth (the raw
/// publisher's best window in the benchmark is of that order).
pub(super) const WINDOW_BATCHES: usize = 4;
/// Batches on the wire at most (many small ones when events trickle in).
pub(super) const MAX_BATCHES_ON_WIRE: usize = 64;

/// A batch taken from the stream, sent (all but its queued events).
pub(super) struct Batch {
    pub(super) events: Vec<OutboxEvent>,
    /// Per event: ordered, with its aggregate's events in the outbox
    /// table, so it goes there too instead of being sent.
    pub(super) queued: Vec<bool>,
    pub(super) unreadable: Vec<Unreadable>,
    pub(super) commit_end: Option<Lsn>,
    pub(super) commit_time: Option<i64>,
}

/// A batch whose confirms are still to come.
pub(super) struct OnWire {
    pub(super) batch: Batch,
    /// Its ordered aggregates (type, id).
    pub(super) ordered: HashSet<(String, String)>,
    /// The receipts of its sent events, in order.
    pub(super) confirms: BoxFuture<'static, Result<Vec<Receipt>>>,
}

/// The batches on the wire, oldest first: settled in that order, so the
/// slot's position only ever moves past settled batches.
#[derive(Default)]
pub(super) struct Window {
    pub(super) batches: VecDeque<OnWire>,
}

impl Window {
    pub(super) fn len(&self) -> usize {
        self.batches.len()
    }

    pub(super) fn events(&self) -> usize {
        self.batches.iter().map(|b| b.batch.events.len()).sum()
    }

    pub(super) fn holds_any(&self, aggregates: &HashSet<(String, String)>) -> bool {
        !aggregates.is_empty()
            && self
                .batches
                .iter()
                .any(|b| !b.ordered.is_disjoint(aggregates))
    }

    pub(super) fn push(&mut self, b: OnWire) {
        self.batches.push_back(b);
    }

    /// The oldest batch (after its confirms resolved).
    pub(super) fn pop(&mut self) -> Batch {
        self.batches
            .pop_front()
            .expect("a batch whose confirms resolved is on the wire")
            .batch
    }

    /// The oldest batch's receipts when they are all in already.
    pub(super) fn ready(&mut self) -> Option<Result<Vec<Receipt>>> {
        self.batches
            .front_mut()
            .and_then(|b| (&mut b.confirms).now_or_never())
    }

    /// Waits for the oldest batch's receipts (for ever when none is on the
    /// wire). Cancel-safe: the confirms stay with their batch.
    pub(super) async fn oldest_confirms(&mut self) -> Result<Vec<Receipt>> {
        match self.batches.front_mut() {
            Some(b) => (&mut b.confirms).await,
            None => std::future::pending().await,
        }
    }

    /// Confirms `lsn` to the slot once the batches on the wire are settled
    /// (at once when none is).
    pub(super) fn confirm_after(&mut self, client: &ReplicationClient, acked: &mut Lsn, lsn: Lsn) {
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
pub(super) fn ordered_aggregates(events: &[OutboxEvent]) -> HashSet<(String, String)> {
    events
        .iter()
        .filter(|e| e.aggregate_seq.is_some())
        .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
        .collect()
}
