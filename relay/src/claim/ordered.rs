//! Ordered events: each aggregate from its head only, in sequence, from
//! the partitions this relay leases and this worker serves.
//!
//! A published event's row is deleted, but its index entries stay until a
//! vacuum may remove them, and none may while something holds the xmin
//! horizon back. So no claim looks for work by walking the aggregates in
//! key order (that steps over the entries of every ordered event published
//! since the horizon was taken, on every claim). Instead each worker keeps:
//!
//! - **a walk cursor** in `outbox_ordered_due_idx` (`(available_at, id)` of
//!   ordered events, migration 17). Each walk (`walk.sql`) reads the due
//!   ordered events of the worker's partitions from the cursor on and
//!   queues their aggregates; the cursor then moves as the relay's
//!   unordered cursor does ([`floor`]): to the last key walked, never past
//!   the floor below which no row can still commit. Only entries written
//!   since the last walk are read. One walk comes before every ordered
//!   claim while the queue has room.
//! - **a queue of aggregates** with due events, claimed in turn: a claim
//!   (`batch.sql`) asks for the heads of the first aggregates queued, reads
//!   each one's chain, and puts back at the end those that may have more
//!   (round robin, so one deep aggregate cannot hold the others back).
//! - **the last sequence number known gone** per aggregate: a head is its
//!   lowest sequence number above it, found in one index descent instead
//!   of stepping over the entries of its published events. A head found
//!   at `n` means every number below `n` is gone for good (numbers are
//!   handed out in commit order and the relay never publishes past a
//!   head), so remembering `n - 1` is safe even if the batch then rolls
//!   back. A walk that sees an event at or below the number remembered (a
//!   dead letter replayed into the outbox) lowers it. It holds only while
//!   the worker serves the partition without a break (another relay may
//!   replay a dead letter meanwhile and fail to publish it), so it is
//!   forgotten when a statement sees the partition not served, and
//!   altogether when the relay may have lost a partition
//!   (`Leases::generation`).
//! - **a sweep**: a walk from the index's beginning, one step every other
//!   claim, until it reaches the cursor. It finds what the cursor passed
//!   without queueing: events of partitions the worker did not serve at the
//!   walk (one starts at once when the worker serves a partition its walks
//!   did not cover: a lease moved), rows a producer wrote with an
//!   `available_at` of its own in the past. Otherwise one
//!   comes every 1 to 30 s, fifty times as long as the last one took (so
//!   under a held horizon it costs about 2% of the worker's time, as the
//!   unordered claim's sweep does). While the worker has no ordered work,
//!   its sweep is only the unordered claim's probe looking from the
//!   index's beginning instead of from the cursor.
//!
//! Why nothing waits forever: an aggregate leaves the queue only when a
//! claim finds its chain at an end (no event above its head, or fewer than
//! it asked for), or its head or a later event not due yet. In the first
//! case every event the aggregate has was claimed; should the batch fail
//! or leave some unsent, the worker queues its aggregates again
//! ([`Ordered::requeue_last`]). In the second, the event not due becomes
//! due after the cursor: a retry's `available_at` is set from the clock
//! when it fails, a delayed event's is in the future, and an operator's
//! skip or retry writes the next head's from the clock. Both are walked
//! when due.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::claim::ClaimRow;
use crate::claim::floor::{self, Key, SWEEP, SWEEP_PAUSE_PER_COST, Start};
use crate::message::OutboxEvent;

/// An aggregate: `(aggregate_type, aggregate_id)`.
pub(crate) type Aggregate = (String, String);

/// About this many aggregates queued at most (a walk waits for room; a
/// failed batch's aggregates go back whatever the room), and as many last
/// sequence numbers remembered (beyond it they are forgotten: a head is
/// then looked for from the aggregate's first entry, once).
pub(crate) const CAP: usize = 65_536;

/// Walk rows a claim may read per head it asks for.
const WALK_PER_HEAD: usize = 4;

/// One worker's ordered claim state (the module's documentation says what
/// each part is for).
#[derive(Debug)]
pub(crate) struct Ordered {
    /// Where the next walk starts, inclusive; `None`: the beginning.
    cursor: Start,
    /// Aggregates with due events, in claim order.
    pending: VecDeque<Aggregate>,
    /// The same, to queue each once.
    queued: HashSet<Aggregate>,
    /// Per aggregate, a sequence number no event of it at or below is in
    /// the outbox any more, and its partition. True only while the worker
    /// serves the partition without a break: another relay may replay a
    /// dead letter below it and fail to publish it. So an entry goes when
    /// a statement sees its partition not served, and all go when the
    /// relay's lease generation changes (a partition lost, a round failed
    /// or late).
    gone: HashMap<Aggregate, (i64, i32)>,
    sweep: Sweep,
    /// Partitions (one bit each) whose events below the cursor were all
    /// walked while the worker served them: their aggregates are queued or
    /// done. A partition the worker serves outside it needs a sweep.
    covered: u64,
    /// The relay's lease generation last seen (`Leases::generation`).
    generation: u64,
    /// The relay's last lease round gave this worker a partition: while
    /// not, its probe looks for nothing (its cursor does not move).
    serving: bool,
    /// Aggregates whose events the last claim returned.
    last: Vec<Aggregate>,
    /// Expected events per aggregate in a claim (1 to 64): deep aggregates
    /// fill a batch with fewer heads. Learnt from each claim.
    chain_hint: usize,
    /// The sweep's period, fixed by a test (`Relay::set_claim_sweep`).
    fixed: Option<Duration>,
    /// The relay's catch-ups taken in so far (`Floor::catch_ups`).
    caught: u64,
}

/// The sweep's state.
#[derive(Debug)]
struct Sweep {
    /// In progress: where its next step starts, what its steps took, and
    /// the partitions every walk since it began served (those it covers
    /// once done).
    at: Option<(Start, Duration, u64)>,
    /// When the next one is due.
    next: Instant,
    /// The next ordered claim takes a step of it.
    turn: bool,
}

/// Which walk a claim takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Walk {
    /// From the worker's cursor.
    Cursor,
    /// The sweep's step.
    Sweep,
}

/// A row of `walk.sql`: the partitions served, and an event walked (all
/// `None` on the row that says only the first).
#[derive(sqlx::FromRow)]
pub(crate) struct Walked {
    held: Vec<i32>,
    /// The transaction's `now()`, which the walk's `due` was judged by.
    now: DateTime<Utc>,
    available_at: Option<DateTime<Utc>>,
    id: Option<Uuid>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    aggregate_seq: Option<i64>,
}

/// The heads a claim asks for: types, ids and the last number known gone
/// of each, as `batch.sql` binds them.
pub(crate) type Request<'a> = (Vec<&'a str>, Vec<&'a str>, Vec<i64>);

impl Default for Ordered {
    fn default() -> Self {
        Self {
            cursor: None,
            pending: VecDeque::new(),
            queued: HashSet::new(),
            gone: HashMap::new(),
            sweep: Sweep {
                at: None,
                next: Instant::now() + SWEEP.0,
                turn: false,
            },
            covered: u64::MAX,
            generation: 0,
            serving: true,
            last: Vec::new(),
            chain_hint: 1,
            fixed: None,
            caught: 0,
        }
    }
}

impl Ordered {
    /// Aggregates queued or a sweep in progress: the worker claims with
    /// `batch.sql` whatever the probe said.
    pub(crate) fn busy(&self) -> bool {
        !self.pending.is_empty() || (self.sweep.at.is_some() && self.serving)
    }

    /// Where the unordered claim's probe looks from: the cursor, or the
    /// index's beginning when a sweep is due (the sweep of a worker with
    /// no ordered work; [`Ordered::probed`] takes its answer), or past
    /// every event while the worker serves no partition (its cursor does
    /// not move then, and a probe from it would step over every entry
    /// published since).
    pub(crate) fn probe_from(&self) -> (Start, bool) {
        if !self.serving {
            (Some(nowhere()), false)
        } else if Instant::now() >= self.sweep.next {
            (None, true)
        } else {
            (self.cursor, false)
        }
    }

    /// Where `batch.sql`'s probe looks from: the cursor, or past every
    /// event while the worker serves no partition.
    pub(crate) fn probe_cursor(&self) -> Start {
        if self.serving {
            self.cursor
        } else {
            Some(nowhere())
        }
    }

    /// The unordered claim's probe answered `waiting` after `took`, with
    /// the floor as it was before the claim's snapshot (`floor`). No ordered event at all at or after where
    /// it looked: the cursor may move up to the floor (the probe would
    /// otherwise step over the entries of the events published just
    /// before it stopped, at every claim). If it looked from the
    /// beginning, it was the sweep: with nothing found the sweep is done,
    /// otherwise the walks take it up.
    pub(crate) fn probed(
        &mut self,
        sweep: bool,
        waiting: bool,
        floor: Option<DateTime<Utc>>,
        took: Duration,
    ) {
        if !waiting && self.serving {
            self.cursor = self.cursor.max(floor::bounded(floor, None));
        }
        if !sweep {
            return;
        }
        if waiting {
            self.start_sweep();
        } else {
            self.sweep.next = Instant::now() + self.pause(took);
        }
    }

    /// The relay's lease generation and the partitions of this worker its
    /// last lease round held (one bit each), before a claim. A new
    /// generation forgets every number known gone. A partition held that
    /// the worker's walks did not cover starts a sweep (they passed its
    /// events: the worker did not serve it then).
    pub(crate) fn leases(&mut self, generation: u64, held: u64) {
        if generation != self.generation {
            self.generation = generation;
            self.gone.clear();
        }
        self.serving = held != 0;
        self.sweep_if_uncovered(held);
    }

    /// The catch-ups this worker has taken in.
    pub(crate) fn caught(&self) -> u64 {
        self.caught
    }

    /// The relay's catch-ups (`Floor::catch_ups`), before a claim: long
    /// writers of the outbox ended since the last one, and the cursor
    /// goes back to where their rows may lie (`from`; the walks passed it
    /// while they were left out of the floor).
    pub(crate) fn catch_up(&mut self, (count, from): (u64, Option<Start>)) {
        self.caught = count;
        if let Some(from) = from {
            self.cursor = self.cursor.min(from);
        }
    }

    /// Starts a sweep (unless one is under way) if the worker serves a
    /// partition (of `held`, one bit each) its walks did not cover.
    fn sweep_if_uncovered(&mut self, held: u64) {
        if held & !self.covered != 0 && self.sweep.at.is_none() {
            self.start_sweep();
        }
    }

    /// A statement saw the worker serve `held` (one bit each): what it
    /// did not serve is covered no more, a sweep in progress cannot cover
    /// it, and what was known gone of it is forgotten.
    fn served(&mut self, held: u64) {
        self.covered &= held;
        if let Some((_, _, through)) = &mut self.sweep.at {
            *through &= held;
        }
        self.gone
            .retain(|_, (_, partition)| held & mask([*partition]) != 0);
    }

    /// The sweep's period as the relay's unordered sweep has it fixed (a
    /// test's), if it does.
    pub(crate) fn fix_sweep(&mut self, fixed: Option<Duration>) {
        if fixed != self.fixed {
            self.fixed = fixed;
            if let Some(every) = fixed {
                self.sweep.next = Instant::now() + every;
            }
        }
    }

    /// The pause after a sweep that took `took`: fifty times as long,
    /// within [`SWEEP`] (or as fixed).
    fn pause(&self, took: Duration) -> Duration {
        self.fixed
            .unwrap_or_else(|| (took * SWEEP_PAUSE_PER_COST).clamp(SWEEP.0, SWEEP.1))
    }

    fn start_sweep(&mut self) {
        self.sweep.at = Some((None, Duration::ZERO, u64::MAX));
        self.sweep.turn = true;
    }

    /// Heads a claim of `batch` events asks for.
    fn heads(&self, batch: usize) -> usize {
        batch.div_ceil(self.chain_hint).max(1)
    }

    /// Rows a walk of a claim of `batch` events reads at most.
    pub(crate) fn walk_limit(batch: usize) -> usize {
        batch * WALK_PER_HEAD
    }

    /// The walks this claim takes, each with where it starts: a step of
    /// the sweep every other claim while one is due or in progress, and
    /// the cursor's walk, each while the queue has room for what it may
    /// add (so no aggregate walked is ever dropped). The cursor's walk
    /// comes at every claim, not only when the queue runs short: a dead
    /// letter replayed into the outbox is seen before the next claim of
    /// its aggregate (the walk lowers the number known gone under it).
    pub(crate) fn walks(&mut self, batch: usize) -> Vec<(Walk, Start)> {
        let mut walks = Vec::with_capacity(2);
        let mut room = CAP.saturating_sub(self.pending.len()) / Self::walk_limit(batch);
        if self.sweep.at.is_none() && Instant::now() >= self.sweep.next {
            self.start_sweep();
        }
        if let Some((at, _, _)) = self.sweep.at {
            if self.sweep.turn && room > 0 {
                walks.push((Walk::Sweep, at));
                room -= 1;
            }
            self.sweep.turn = !self.sweep.turn;
        }
        if room > 0 {
            walks.push((Walk::Cursor, self.cursor));
        }
        walks
    }

    /// A walk's rows taken in: their aggregates queued, its cursor moved
    /// (bounded by `floor`, read before the walk), the sweep ended when it
    /// reached the cursor. `limit` is what it asked for; `took`, how long
    /// it ran.
    pub(crate) fn walked(
        &mut self,
        walk: Walk,
        rows: Vec<Walked>,
        limit: usize,
        floor: Option<DateTime<Utc>>,
        took: Duration,
    ) {
        // Due means due at the transaction's start (`now()`): an event
        // that committed since, with a key between that and the floor,
        // was not walked. The cursor stays below both.
        let floor = match (floor, rows.first().map(|r| r.now)) {
            (Some(floor), Some(now)) => Some(floor.min(now)),
            (floor, _) => floor,
        };
        let held = rows.first().map_or(0, |r| mask(r.held.iter().copied()));
        if held == 0 {
            // It served no partition (a worker's first walks may come
            // before its leases): it learnt nothing and moves nothing. A
            // sweep has nothing to cover: it ends (the next partition
            // served that was not covered starts another).
            if walk == Walk::Sweep {
                self.sweep.at = None;
                self.sweep.next = Instant::now() + self.pause(took);
            }
            return;
        }
        self.served(held);
        let mut seen = 0;
        let mut last: Option<Key> = None;
        for r in rows {
            let (Some(at), Some(id), Some(t), Some(a), Some(seq)) = (
                r.available_at,
                r.id,
                r.aggregate_type,
                r.aggregate_id,
                r.aggregate_seq,
            ) else {
                continue;
            };
            seen += 1;
            last = Some((at, id));
            let aggregate = (t, a);
            if let Some((gone, _)) = self.gone.get_mut(&aggregate)
                && *gone >= seq
            {
                *gone = seq - 1;
            }
            self.enqueue(aggregate);
        }
        // Fewer rows than asked for: the walk reached the end.
        let stopped = if seen < limit { None } else { last };
        match walk {
            Walk::Cursor => self.cursor = floor::bounded(floor, stopped),
            Walk::Sweep => self.swept(stopped, took),
        }
        // It served a partition the walks before did not cover.
        self.sweep_if_uncovered(held);
    }

    /// A step of the sweep that stopped at `stopped` (`None`: the end).
    fn swept(&mut self, stopped: Start, took: Duration) {
        let Some((_, spent, through)) = self.sweep.at else {
            return;
        };
        let spent = spent + took;
        let done = match (stopped, self.cursor) {
            (Some(at), Some(cursor)) => at >= cursor,
            _ => true,
        };
        if done {
            self.covered = through;
            self.sweep.at = None;
            self.sweep.next = Instant::now() + self.pause(spent);
        } else {
            self.sweep.at = Some((stopped, spent, through));
        }
    }

    /// Queues `aggregate` at the end unless it is queued.
    fn enqueue(&mut self, aggregate: Aggregate) {
        if !self.queued.contains(&aggregate) {
            self.queued.insert(aggregate.clone());
            self.pending.push_back(aggregate);
        }
    }

    /// The heads a claim of `batch` events asks for: the first aggregates
    /// queued.
    pub(crate) fn request(&self, batch: usize) -> Request<'_> {
        let mut request: Request<'_> = Default::default();
        for aggregate in self.pending.iter().take(self.heads(batch)) {
            request.0.push(aggregate.0.as_str());
            request.1.push(aggregate.1.as_str());
            request.2.push(self.gone.get(aggregate).map_or(0, |g| g.0));
        }
        request
    }

    /// The ordered rows of a claim of `batch` events read back: the
    /// aggregates asked for put back at the end of the queue or let go,
    /// what is gone and the chain hint learnt. Returns the events to
    /// publish, in chain order.
    pub(crate) fn read_back(
        &mut self,
        mut rows: Vec<ClaimRow>,
        held: &[i32],
        batch: usize,
    ) -> Vec<OutboxEvent> {
        rows.sort_by_key(|r| (r.ord, r.event.aggregate_seq));
        let asked = self.heads(batch).min(self.pending.len());
        if asked > 0 {
            // Aggregates of a partition it did not serve come back with
            // nothing and leave the queue: their events are not covered.
            self.served(mask(held.iter().copied()));
        }
        let chains = chains(&rows, asked);
        let due_heads = chains.iter().filter(|c| c.due).count();
        let n = (batch / due_heads.max(1)).max(1);
        if self.gone.len() + asked > CAP {
            self.gone.clear();
        }
        self.last.clear();
        for chain in &chains {
            let Some(aggregate) = self.pending.pop_front() else {
                break;
            };
            let more = match chain.head {
                None => false,
                Some(head) => {
                    self.gone
                        .insert(aggregate.clone(), (head - 1, chain.partition));
                    if chain.due {
                        self.last.push(aggregate.clone());
                    }
                    // A head being retried goes alone: the rest after it.
                    // Otherwise a chain as long as asked for may go on.
                    chain.due && ((chain.retried && chain.read > 1) || chain.due_len >= n)
                }
            };
            if more {
                self.pending.push_back(aggregate);
            } else {
                self.queued.remove(&aggregate);
            }
        }
        let lengths: Vec<usize> = chains.iter().filter(|c| c.due).map(|c| c.due_len).collect();
        self.chain_hint = next_chain_hint(self.chain_hint, &lengths, batch);
        due_chains(rows)
    }

    /// The last claim's events are back in the outbox, or some of them
    /// (its batch failed, or left events unsent): their aggregates go to
    /// the front of the queue (those not queued already).
    pub(crate) fn requeue_last(&mut self) {
        for aggregate in std::mem::take(&mut self.last).into_iter().rev() {
            if !self.queued.contains(&aggregate) {
                self.queued.insert(aggregate.clone());
                self.pending.push_front(aggregate);
            }
        }
    }
}

/// A key after every event's (9999-12-31).
fn nowhere() -> Key {
    let end = DateTime::from_timestamp(253_402_300_799, 0).unwrap_or(DateTime::<Utc>::MAX_UTC);
    (end, Uuid::max())
}

/// Partitions as bits (one per partition, 0 to 63).
pub(crate) fn mask(partitions: impl IntoIterator<Item = i32>) -> u64 {
    partitions
        .into_iter()
        .filter(|p| (0..64).contains(p))
        .fold(0, |m, p| m | 1 << p)
}

/// One aggregate's share of a claim.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Chain {
    /// Its head's sequence number (`None`: nothing came back for it).
    head: Option<i64>,
    /// Its partition.
    partition: i32,
    /// The head is due.
    due: bool,
    /// The head was tried before.
    retried: bool,
    /// Rows read.
    read: usize,
    /// Due rows from the head on, up to the first not due.
    due_len: usize,
}

/// The claim's rows (sorted by `(ord, aggregate_seq)`) per aggregate asked
/// for, in the order asked (`ord` is 1 for the first).
fn chains(rows: &[ClaimRow], asked: usize) -> Vec<Chain> {
    let mut chains = vec![Chain::default(); asked];
    for r in rows {
        let Some(chain) = r
            .ord
            .and_then(|o| usize::try_from(o - 1).ok())
            .and_then(|i| chains.get_mut(i))
        else {
            continue;
        };
        if chain.head.is_none() {
            chain.head = r.event.aggregate_seq;
            chain.partition = r.partition.unwrap_or_default();
            chain.due = r.due;
            chain.retried = r.event.attempts > 0;
        }
        if r.due && chain.due_len == chain.read {
            chain.due_len += 1;
        }
        chain.read += 1;
    }
    chains
}

/// The chain length to plan the next claim with: doubled while most due
/// heads filled their chain (their aggregates have more queued), else the
/// average chain seen.
fn next_chain_hint(hint: usize, due: &[usize], batch: usize) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::EventRow;

    const ALL: u64 = u64::MAX;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(s, 0).unwrap()
    }

    fn walked(held: &[i32], events: &[(i64, &str, i64)]) -> Vec<Walked> {
        let row = |e: Option<&(i64, &str, i64)>| Walked {
            held: held.to_vec(),
            now: at(1_000),
            available_at: e.map(|e| at(e.0)),
            id: e.map(|_| Uuid::now_v7()),
            aggregate_type: e.map(|_| "account".to_owned()),
            aggregate_id: e.map(|e| e.1.to_owned()),
            aggregate_seq: e.map(|e| e.2),
        };
        if events.is_empty() {
            return vec![row(None)];
        }
        events.iter().map(|e| row(Some(e))).collect()
    }

    /// A claim's ordered row: aggregate `a` (asked for at `ord`), its
    /// `seq`, due or not, tried `attempts` times.
    fn claimed(ord: i64, a: &str, seq: i64, due: bool, attempts: i32) -> ClaimRow {
        ClaimRow {
            event: EventRow {
                id: Uuid::now_v7(),
                aggregate_type: "account".into(),
                aggregate_id: a.into(),
                event_type: "Changed".into(),
                payload: "{}".into(),
                headers: "{}".into(),
                exchange: None,
                routing_key: None,
                created_at: at(0),
                attempts,
                aggregate_seq: Some(seq),
            },
            available_at: Some(at(0)),
            due,
            partition: Some(0),
            ord: Some(ord),
        }
    }

    impl Ordered {
        /// The number a claim would ask `aggregate`'s head above.
        fn request_after(&self, aggregate: &Aggregate) -> i64 {
            self.gone.get(aggregate).map_or(0, |g| g.0)
        }
    }

    /// A walk of up to 10 rows that served `held` and walked `events`,
    /// the floor at 100.
    fn step(o: &mut Ordered, walk: Walk, held: &[i32], events: &[(i64, &str, i64)]) {
        o.walked(
            walk,
            walked(held, events),
            10,
            Some(at(100)),
            Duration::ZERO,
        );
    }

    fn queued(o: &Ordered) -> Vec<&str> {
        o.pending.iter().map(|(_, a)| a.as_str()).collect()
    }

    #[test]
    fn a_walk_queues_each_aggregate_once_and_moves_its_cursor_no_further_than_the_floor() {
        let mut o = Ordered::default();
        let rows = walked(&[0], &[(10, "a", 1), (11, "b", 1), (12, "a", 2)]);
        o.walked(Walk::Cursor, rows, 3, Some(at(100)), Duration::ZERO);
        assert_eq!(queued(&o), ["a", "b"]);
        assert_eq!(
            o.cursor.map(|k| k.0),
            Some(at(12)),
            "a full walk stops at its last row"
        );
        o.walked(
            Walk::Cursor,
            walked(&[0], &[]),
            3,
            Some(at(100)),
            Duration::ZERO,
        );
        assert_eq!(
            o.cursor,
            Some((at(100), Uuid::nil())),
            "at the end: the floor"
        );
        o.walked(Walk::Cursor, walked(&[0], &[]), 3, None, Duration::ZERO);
        assert_eq!(o.cursor, None, "floor unknown: the beginning");
    }

    #[test]
    fn a_walk_that_serves_no_partition_moves_nothing() {
        let mut o = Ordered {
            cursor: Some((at(50), Uuid::nil())),
            ..Default::default()
        };
        o.walked(
            Walk::Cursor,
            walked(&[], &[]),
            3,
            Some(at(100)),
            Duration::ZERO,
        );
        assert_eq!(o.cursor, Some((at(50), Uuid::nil())));
        assert_eq!(o.covered, ALL);
    }

    #[test]
    fn chains_that_may_go_on_stay_queued_and_ended_ones_leave() {
        let mut o = Ordered::default();
        let rows = walked(
            &[0],
            &[
                (1, "deep", 1),
                (2, "short", 1),
                (3, "gone", 1),
                (4, "late", 1),
            ],
        );
        o.walked(Walk::Cursor, rows, 100, Some(at(100)), Duration::ZERO);
        // A batch of 4 with three due heads: chains of one each.
        let rows = vec![
            claimed(1, "deep", 5, true, 0),
            claimed(2, "short", 1, true, 0),
            claimed(4, "late", 2, false, 0),
        ];
        let events = o.read_back(rows, &[0], 4);
        assert_eq!(events.len(), 2, "the due heads");
        // Two due heads of a batch of 4: chains of 2 asked for; "deep" and
        // "short" came with 1 (ended), "late" is not due (walked again
        // when it is), "gone" came with nothing.
        assert_eq!(queued(&o), Vec::<&str>::new());
        assert_eq!(
            o.gone.get(&("account".into(), "deep".into())),
            Some(&(4, 0))
        );
        assert_eq!(
            o.gone.get(&("account".into(), "late".into())),
            Some(&(1, 0))
        );
        assert!(!o.gone.contains_key(&("account".into(), "gone".into())));
    }

    #[test]
    fn a_full_chain_and_a_retried_head_with_events_behind_it_stay_queued_at_the_end() {
        let mut o = Ordered::default();
        let rows = walked(&[0], &[(1, "full", 1), (2, "retried", 1), (3, "ended", 1)]);
        o.walked(Walk::Cursor, rows, 100, Some(at(100)), Duration::ZERO);
        // Batch 6, three due heads: n = 2.
        let rows = vec![
            claimed(1, "full", 1, true, 0),
            claimed(1, "full", 2, true, 0),
            claimed(2, "retried", 7, true, 3),
            claimed(2, "retried", 8, true, 0),
            claimed(3, "ended", 1, true, 0),
        ];
        let events = o.read_back(rows, &[0], 6);
        let sent: Vec<(String, Option<i64>)> = events
            .iter()
            .map(|e| (e.aggregate_id.clone(), e.aggregate_seq))
            .collect();
        assert_eq!(
            sent,
            [
                ("full".into(), Some(1)),
                ("full".into(), Some(2)),
                ("retried".into(), Some(7)),
                ("ended".into(), Some(1))
            ],
            "a retried head goes alone"
        );
        assert_eq!(queued(&o), ["full", "retried"]);
        // The batch failed: what ended goes back first.
        o.requeue_last();
        assert_eq!(queued(&o), ["ended", "full", "retried"]);
    }

    #[test]
    fn a_replayed_event_below_what_is_gone_lowers_it() {
        let mut o = Ordered::default();
        o.gone.insert(("account".into(), "a".into()), (9, 0));
        step(&mut o, Walk::Cursor, &[0], &[(5, "a", 4)]);
        assert_eq!(o.request(10).2, [3]);
    }

    #[test]
    fn a_partition_served_that_the_walks_did_not_cover_is_swept_and_covered_after() {
        let mut o = Ordered::default();
        step(&mut o, Walk::Cursor, &[0], &[]);
        assert_eq!(o.covered, 1);
        o.leases(0, 1);
        assert!(o.sweep.at.is_none(), "partition 0 is covered");
        // Partition 1 leased now: the walk above passed its events.
        o.leases(0, 0b11);
        assert!(o.busy(), "a sweep");
        assert_eq!(o.walks(10)[0], (Walk::Sweep, None));
        step(&mut o, Walk::Sweep, &[0, 1], &[(7, "b", 1)]);
        assert!(o.sweep.at.is_none(), "it reached the cursor");
        assert_eq!(o.covered, 0b11);
        assert_eq!(queued(&o), ["b"]);
        // A batch that no longer served partition 1 uncovers it.
        let _ = o.read_back(Vec::new(), &[0], 10);
        assert_eq!(o.covered, 1);
    }

    #[test]
    fn what_is_known_gone_is_forgotten_when_its_partition_may_have_been_served_elsewhere() {
        let mut o = Ordered::default();
        let a: Aggregate = ("account".into(), "a".into());
        let b: Aggregate = ("account".into(), "b".into());
        o.gone.insert(a.clone(), (5, 0));
        o.gone.insert(b.clone(), (7, 1));
        step(&mut o, Walk::Cursor, &[0], &[]);
        assert_eq!(o.request_after(&a), 5, "partition 0 served throughout");
        assert_eq!(o.request_after(&b), 0, "partition 1 not served at the walk");
        o.leases(1, 1);
        assert_eq!(o.request_after(&a), 0, "a new lease generation");
    }

    #[test]
    fn the_cursor_stays_below_the_transactions_now_as_well_as_the_floor() {
        let mut o = Ordered::default();
        let mut rows = walked(&[0], &[]);
        rows[0].now = at(80);
        o.walked(Walk::Cursor, rows, 10, Some(at(100)), Duration::ZERO);
        assert_eq!(o.cursor, Some((at(80), Uuid::nil())));
    }

    #[test]
    fn a_catch_up_sends_the_cursor_back_once() {
        let mut o = Ordered::default();
        step(&mut o, Walk::Cursor, &[0], &[]);
        assert_eq!(o.cursor, Some((at(100), Uuid::nil())));
        o.catch_up((1, Some(Some((at(40), Uuid::nil())))));
        assert_eq!(o.cursor, Some((at(40), Uuid::nil())));
        assert_eq!(o.caught(), 1);
        step(&mut o, Walk::Cursor, &[0], &[]);
        o.catch_up((1, None));
        assert_eq!(o.cursor, Some((at(100), Uuid::nil())), "once");
        o.walked(
            Walk::Cursor,
            walked(&[0], &[]),
            10,
            Some(at(90)),
            Duration::ZERO,
        );
        o.catch_up((2, Some(Some((at(95), Uuid::nil())))));
        assert_eq!(o.cursor, Some((at(90), Uuid::nil())), "never forward");
        o.catch_up((3, Some(None)));
        assert_eq!(o.cursor, None, "from the beginning");
    }

    #[test]
    fn a_sweep_whose_walk_serves_no_partition_ends() {
        let mut o = Ordered::default();
        o.start_sweep();
        assert!(o.busy());
        step(&mut o, Walk::Sweep, &[], &[]);
        assert!(
            !o.busy(),
            "nothing to sweep: a worker that claims while busy would spin"
        );
    }

    #[test]
    fn a_worker_that_serves_no_partition_probes_for_nothing() {
        let mut o = Ordered::default();
        o.leases(0, 0);
        assert_eq!(o.probe_from(), (Some(nowhere()), false));
        assert_eq!(o.probe_cursor(), Some(nowhere()));
        o.leases(0, 1);
        assert_eq!(o.probe_cursor(), None);
    }

    #[test]
    fn a_sweep_steps_every_other_claim_until_it_reaches_the_cursor() {
        let mut o = Ordered::default();
        o.fix_sweep(Some(Duration::from_secs(3600)));
        o.cursor = Some((at(50), Uuid::nil()));
        o.start_sweep();
        let mut steps = 0;
        for claim in 0..6 {
            let walks = o.walks(1);
            let sweep = walks.iter().find(|w| w.0 == Walk::Sweep).copied();
            assert_eq!(sweep.is_some(), claim % 2 == 0, "claim {claim}");
            if let Some((walk, _)) = sweep {
                steps += 1;
                let t = 10 * steps;
                let rows = walked(&[0], &[(t, "x", 1), (t + 1, "y", 1)]);
                o.walked(walk, rows, 2, Some(at(100)), Duration::ZERO);
            }
        }
        let at_now = o.sweep.at.and_then(|(at, _, _)| at).map(|k| k.0);
        assert_eq!(at_now, Some(at(31)), "three steps (to 11, 21, 31) of 50");
        o.walked(
            Walk::Sweep,
            walked(&[0], &[(60, "z", 1)]),
            2,
            Some(at(100)),
            Duration::ZERO,
        );
        assert!(o.sweep.at.is_none(), "past the cursor: done");
    }
}
