//! Pure planners of a pass: which ids the inbox records, which events run
//! and which the sequencer sees, which lose their inbox row.

use std::collections::HashSet;

use super::{Batch, Verdict};
use crate::event::Event;
use crate::handler::Outcome;

/// The batch's event ids, sorted and unique: the inbox's record takes its
/// row locks in this order.
pub(super) fn inbox_keys(events: &[Event]) -> Vec<&str> {
    let mut keys: Vec<&str> = events.iter().map(|e| e.id()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// The deliveries whose handler runs (the first copy of each fresh id),
/// and those the pass looks at: the same, plus with sequencing every
/// sequenced copy, since each holds a number of its aggregate whether it
/// runs or not (the id was applied before, or comes twice in this batch):
/// the sequencer must see each one, or the aggregate would wait for a
/// number for ever. An id enqueued again after its first copy left the
/// outbox comes back with a new number. The handler runs for the copy
/// whose number is next.
pub(super) fn select(
    batch: &Batch<'_>,
    fresh: &HashSet<&str>,
    sequencing: bool,
) -> (Vec<usize>, Vec<usize>) {
    let events = batch.events;
    // Only the first delivery of a fresh key runs; later copies in the
    // same batch are duplicates.
    let mut first = HashSet::new();
    let to_handle: Vec<usize> = (0..events.len())
        .filter(|&i| fresh.contains(events[i].id()) && first.insert(events[i].id()))
        .collect();
    let passes: Vec<usize> = if sequencing {
        (0..events.len())
            .filter(|&i| to_handle.binary_search(&i).is_ok() || batch.position(i).is_some())
            .collect()
    } else {
        to_handle.clone()
    };
    (to_handle, passes)
}

/// Fresh events not applied (failed, deferred, stale): they lose their
/// inbox row, so a later copy or a replay runs again. Per id: with
/// sequencing, another copy of it may be the one applied.
pub(super) fn unapplied<'e>(
    events: &'e [Event],
    to_handle: &[usize],
    verdicts: &[Verdict],
) -> Vec<&'e str> {
    let acked: HashSet<&str> = (0..events.len())
        .filter(|&i| matches!(verdicts[i], Verdict::Handled(Outcome::Ack)))
        .map(|i| events[i].id())
        .collect();
    to_handle
        .iter()
        .map(|&i| events[i].id())
        .filter(|id| !acked.contains(id))
        .collect()
}
