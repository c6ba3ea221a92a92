//! The classification of a batch's sequenced events, in delivery order,
//! against the last applied sequence numbers of their aggregates: a pure
//! planner over the rows the lock statement returned.

use std::collections::{HashMap, HashSet};

use super::position::{Aggregate, Position};

/// One row returned by the lock statement.
#[derive(Debug)]
pub(crate) struct Locked {
    pub(crate) aggregate: Aggregate,
    pub(crate) last: i64,
    /// The row did not exist: this consumer never saw the aggregate.
    pub(crate) created: bool,
}

/// Whether it is a sequenced event's turn: where its number stands against
/// its aggregate's last applied one (see the glossary in the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Next in sequence: run the handler.
    Apply,
    /// At or below the last applied number: ack, do not run.
    Stale { last: i64 },
    /// Beyond the next expected number: not applied, retried later.
    Gap { expected: i64 },
    /// An earlier event of its aggregate in this batch was not applied.
    HeldBack { expected: i64 },
}

/// The sequence state of a batch's aggregates while its events are
/// classified in delivery order.
#[derive(Debug)]
pub(crate) struct Sequencer {
    tracks: HashMap<Aggregate, Track>,
}

#[derive(Debug)]
struct Track {
    /// As stored when locked.
    stored: i64,
    /// Last applied, including this batch.
    last: i64,
    /// An event of this aggregate failed in this batch.
    blocked: bool,
}

impl Sequencer {
    /// `positions`: the batch's fresh sequenced events; with
    /// `accept_first_seen`, the lowest sequence number among those of an
    /// aggregate without a row sets its start (not the first in delivery
    /// order: a lower one may come back from the retry queue behind a
    /// higher one, and must not become stale).
    pub(crate) fn new<'p>(
        rows: impl IntoIterator<Item = Locked>,
        accept_first_seen: bool,
        positions: impl Iterator<Item = &'p Position>,
    ) -> Self {
        let mut first_seen = HashSet::new();
        let mut tracks: HashMap<Aggregate, Track> = rows
            .into_iter()
            .map(|r| {
                if r.created && accept_first_seen {
                    first_seen.insert(r.aggregate.clone());
                }
                let track = Track {
                    stored: r.last,
                    last: r.last,
                    blocked: false,
                };
                (r.aggregate, track)
            })
            .collect();
        if !first_seen.is_empty() {
            let mut lowest: HashMap<Aggregate, i64> = HashMap::new();
            for p in positions {
                if let Some(l) = lowest.get_mut(&p.aggregate) {
                    *l = (*l).min(p.seq);
                } else if first_seen.contains(&p.aggregate) {
                    lowest.insert(p.aggregate.clone(), p.seq);
                }
            }
            for (aggregate, seq) in lowest {
                if let Some(t) = tracks.get_mut(&aggregate) {
                    // Recorded even if that event then fails: its retry
                    // must still be the expected one.
                    t.last = seq - 1;
                }
            }
        }
        Self { tracks }
    }

    /// Classifies the next event of the batch (in delivery order).
    pub(crate) fn turn(&self, p: &Position) -> Turn {
        let Some(t) = self.tracks.get(&p.aggregate) else {
            // Every aggregate of the batch was locked; never reached.
            return Turn::HeldBack { expected: p.seq };
        };
        if p.seq <= t.last {
            Turn::Stale { last: t.last }
        } else if t.blocked {
            Turn::HeldBack {
                expected: t.last + 1,
            }
        } else if p.seq > t.last + 1 {
            Turn::Gap {
                expected: t.last + 1,
            }
        } else {
            Turn::Apply
        }
    }

    /// Records the final outcome of an event decided [`Turn::Apply`].
    pub(crate) fn record(&mut self, p: &Position, applied: bool) {
        if let Some(t) = self.tracks.get_mut(&p.aggregate) {
            if applied {
                t.last = p.seq;
            } else {
                t.blocked = true;
            }
        }
    }

    /// The aggregates whose last sequence number changed, sorted.
    pub(super) fn moved(&self) -> Vec<(&Aggregate, i64)> {
        let mut moved: Vec<(&Aggregate, i64)> = self
            .tracks
            .iter()
            .filter(|(_, t)| t.last != t.stored)
            .map(|(a, t)| (a, t.last))
            .collect();
        moved.sort_unstable();
        moved
    }
}
