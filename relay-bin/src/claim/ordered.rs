//! Ordered events: each aggregate from its head only, in sequence, from
//! the partitions this relay leases and this worker serves. The walk over
//! the heads of a partition is the `outbox_heads` function (migration 3);
//! here the batch is planned (heads per partition, events per chain, learnt
//! from each claim), the rows are grouped into chains, and each
//! partition's cursor moves on (round robin over aggregates).

use std::collections::HashMap;

use crate::claim::{ClaimRow, ClaimState};
use crate::message::OutboxEvent;

/// How one claim reads this worker's partitions, planned from the batch,
/// the partitions held and the chains the last claims saw.
pub(crate) struct Plan {
    batch_size: usize,
    /// Due heads per partition: the batch spread over this worker's share
    /// of the relay's partitions.
    pub(crate) per_partition: usize,
    /// Aggregates looked at per partition, due or not: bounds the walk
    /// when many heads are backing off.
    pub(crate) scan_per_partition: usize,
}

impl Plan {
    pub(crate) fn new(batch_size: usize, held: Option<usize>, session: &ClaimState) -> Self {
        let held = held.map_or(64, |n| n.max(1));
        let share = held.div_ceil(session.workers).max(1);
        let per_partition = batch_size.div_ceil(share * session.chain_hint).max(1);
        Self {
            batch_size,
            per_partition,
            scan_per_partition: (per_partition * 4).max(64),
        }
    }

    /// The ordered rows of a claim (in chain order) read back: moves the
    /// worker's cursors and chain hint, and returns the events to publish.
    pub(crate) fn read_back(
        &self,
        rows: Vec<ClaimRow>,
        session: &mut ClaimState,
    ) -> Vec<OutboxEvent> {
        let claimed = chains(&rows);
        advance_cursors(
            &mut session.cursors,
            &claimed,
            self.per_partition,
            self.scan_per_partition,
        );
        session.chain_hint = next_chain_hint(session.chain_hint, &claimed, self.batch_size);
        due_chains(rows)
    }
}

/// A chain: one aggregate's share of an ordered claim, its head and the
/// consecutive events behind it.
struct Chain<'a> {
    partition: i32,
    key: (&'a str, &'a str),
    /// The head is due (a head backing off comes alone, not due).
    due: bool,
    /// Due events of the chain.
    len: usize,
}

/// The claim's rows grouped by aggregate, in claim order.
fn chains(rows: &[ClaimRow]) -> Vec<Chain<'_>> {
    let mut chains: Vec<Chain<'_>> = Vec::new();
    for r in rows {
        let key = (
            r.event.aggregate_type.as_str(),
            r.event.aggregate_id.as_str(),
        );
        match chains.last_mut() {
            Some(chain) if chain.key == key => chain.len += usize::from(r.due),
            _ => chains.push(Chain {
                partition: r.partition.unwrap_or_default(),
                key,
                due: r.due,
                len: usize::from(r.due),
            }),
        }
    }
    chains
}

/// Moves each partition's cursor past the last aggregate looked at, or back
/// to the start when the walk reached the partition's end (fewer than
/// `per_partition` due heads and fewer than `scan` heads in all).
fn advance_cursors(
    cursors: &mut HashMap<i32, (String, String)>,
    chains: &[Chain<'_>],
    per_partition: usize,
    scan: usize,
) {
    // Per partition: heads seen, due heads, last head.
    let mut heads: HashMap<i32, (usize, usize, (&str, &str))> = HashMap::new();
    for chain in chains {
        let entry = heads.entry(chain.partition).or_insert((0, 0, chain.key));
        entry.0 += 1;
        entry.1 += usize::from(chain.due);
        entry.2 = chain.key;
    }
    cursors.clear();
    for (partition, (seen, due, (t, a))) in heads {
        if due >= per_partition || seen >= scan {
            cursors.insert(partition, (t.to_owned(), a.to_owned()));
        }
    }
}

/// The chain length to plan the next claim with: doubled while most due
/// heads filled their chain (their aggregates have more queued), else the
/// average chain seen.
fn next_chain_hint(hint: usize, chains: &[Chain<'_>], batch: usize) -> usize {
    let due: Vec<usize> = chains.iter().filter(|r| r.due).map(|r| r.len).collect();
    if due.is_empty() {
        return hint;
    }
    let heads = due.len();
    let cap = (batch / heads).max(1);
    let full = due.iter().filter(|&&n| n >= cap).count();
    if full * 4 >= heads * 3 {
        (hint * 2).min(64)
    } else {
        due.iter().sum::<usize>().div_ceil(heads).clamp(1, 64)
    }
}

/// The ordered events to publish: each aggregate's chain (head first, in
/// sequence) up to its first event that is not due yet. A head being
/// retried goes alone: the events behind it are not sent again and again
/// while it keeps failing.
fn due_chains(rows: Vec<ClaimRow>) -> Vec<OutboxEvent> {
    let mut out: Vec<OutboxEvent> = Vec::with_capacity(rows.len());
    let mut stopped: Option<(String, String)> = None;
    let mut current: Option<(String, String)> = None;
    for ClaimRow { event, due, .. } in rows {
        let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
        if stopped.as_ref() == Some(&key) {
            continue;
        }
        let head = current.as_ref() != Some(&key);
        if !due || (head && event.attempts > 0) {
            if due {
                out.push(event.into());
            }
            stopped = Some(key);
            continue;
        }
        current = Some(key);
        out.push(event.into());
    }
    out
}
