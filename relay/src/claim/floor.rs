//! Where the unordered claim starts in `outbox_due_idx`: never again at
//! the index's beginning once the drained part is known to stay drained.
//!
//! A published event's row is deleted, but its index entry stays until a
//! vacuum may remove it, and no vacuum may while anything in the database
//! holds the xmin horizon back (a long report, a forgotten `BEGIN`, a
//! standby's feedback, another tool's slot). A claim that starts at the
//! index's beginning visits every such entry and its heap tuple before it
//! finds a live row: with the horizon held for an hour at 1,000 events/s,
//! 3.6 million visits per claim.
//!
//! So the relay claims from a cursor, an `(available_at, id)` key below
//! which no claimable row can be waiting, shared by its workers, and moves
//! it forward after each
//! claim: to the last key it claimed, or, once it has caught up, to the
//! relay's **floor**, below which no row can still commit. Rows commit out
//! of key order, so the floor is not "the last key seen" (the trap of an
//! `id > last seen` cursor) but is read from the lock table:
//!
//! - Since migration 15, a row's `available_at` defaults to
//!   `clock_timestamp()`, the moment the row is written (the relay's own
//!   writes use it too), not the start of its transaction.
//! - A transaction that writes to the outbox holds `RowExclusiveLock` on
//!   it from before its first row until it ends, and `pg_locks` shows it
//!   to any role.
//! - Every [`EVERY`], the floor task reads the clock and the table's
//!   `RowExclusiveLock` holders. A holder first seen in this reading took
//!   its lock after the previous one, so its rows carry keys after the
//!   previous reading's clock. A transaction not holding the lock now
//!   writes its rows after now.
//! - The floor is the earliest of now and each holder's bound, less
//!   [`MARGIN`] (for the clock and the order of the reading's two parts).
//!   A holder present at the relay's first reading bounds nothing: the
//!   floor stays unknown, and the claim starts at the beginning, until it
//!   ends (or is long, below).
//! - A holder the readings have seen for more than [`LONG`] (a producer's
//!   transaction left open, "idle in transaction", or a slow batch job;
//!   at the relay's first reading, counted from its transaction's start)
//!   bounds the floor no more: otherwise every claim would start at its
//!   first row and walk the entries of every event published since (it
//!   holds the xmin horizon too, so no vacuum removes them). Its rows can
//!   only become visible when it ends, so the reading that sees a long
//!   holder gone **catches up**: the cursor goes back to that holder's
//!   bound (and so does each worker's ordered cursor,
//!   [`Floor::catch_ups`]), once, claims in flight do not move it
//!   forward again, and the workers are woken (its commit's wake-up came
//!   while its rows lay behind the cursors). Its events go out a floor
//!   reading (half a second) after it commits. Holders are followed by
//!   their transaction id once they have one: a `PREPARE TRANSACTION`
//!   moves a transaction's locks to another virtual transaction, and
//!   would otherwise look like its end.
//!
//! What the floor does not see, a sweep catches: every second or more
//! ([`SWEEP`]: fifty times as long as the last sweep took, so a sweep of
//! an index full of dead entries comes every 10 to 30 s), one claim of the
//! relay starts at the index's beginning. That covers a row
//! a producer wrote with an `available_at` of its own in the past, and rows
//! another relay claimed and then left (it crashed, or its broker failed and
//! its batch rolled back: this relay's own rollbacks rewind every worker at
//! once, see [`Floor::rewind`]). A long transaction that has written to
//! the outbox is caught up from when it ends (above).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::Ident;
use sqlx::{PgPool, SqlStr};
use uuid::Uuid;

/// How often the floor task reads the lock table.
pub(crate) const EVERY: Duration = Duration::from_millis(500);

/// What the floor keeps below the readings: clock steps the kernel smooths
/// out, and the order of the clock and the lock table within one reading.
pub(crate) const MARGIN: Duration = Duration::from_secs(1);

/// How long a writer of the outbox may hold the floor back: past it, it
/// is left out of the floor, and its end brings a catch-up.
pub(crate) const LONG: Duration = Duration::from_secs(2);

/// Catch-ups remembered for workers that have not seen them yet (one that
/// missed more goes back to the beginning).
const CATCH_UPS_KEPT: usize = 64;

/// How often one claim of the relay starts at the index's beginning, at
/// most and at least: within these, 50 times as long as the last such
/// claim took, so a sweep costs about 2% of a worker's time whatever the
/// index holds (a claim walking 3.6 million dead entries takes about a
/// second; on an index without them, a millisecond).
pub(crate) const SWEEP: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// A sweep's pause over its own duration.
pub(crate) const SWEEP_PAUSE_PER_COST: u32 = 50;

/// How long after a rewind claims start at the beginning and leave the
/// cursor where it is.
pub(crate) const REWIND_HOLD: Duration = Duration::from_secs(1);

/// A key of the claim index: `(available_at, id)`.
pub(crate) type Key = (DateTime<Utc>, Uuid);

/// Where an unordered claim starts, inclusive; `None`: at the index's
/// beginning (`-infinity` in the statement, which PostgreSQL's own value
/// can reach and chrono's cannot).
pub(crate) type Start = Option<Key>;

fn beginning() -> Start {
    None
}

/// Where a cursor goes after a walk that stopped at `last` (`None`: it
/// reached the end), with the floor at `floor`: the earlier of the two,
/// never past the floor (unknown: back to the beginning).
pub(crate) fn bounded(floor: Option<DateTime<Utc>>, last: Option<Key>) -> Start {
    match (floor, last) {
        (None, _) => beginning(),
        (Some(floor), None) => Some((floor, Uuid::nil())),
        (Some(floor), Some(last)) => Some(last.min((floor, Uuid::nil()))),
    }
}

/// The relay's floor and its workers' shared cursor, moved by the floor
/// task and by each claim.
#[derive(Debug)]
pub(crate) struct Floor {
    /// The floor, microseconds since the Unix epoch; `i64::MIN`: unknown.
    at_us: AtomicI64,
    /// Where the relay's next unordered claim starts. One for all its
    /// workers: what one worker claimed or passed, the others need not walk
    /// again (a worker that starts takes it up at once).
    cursor: std::sync::Mutex<Cursor>,
    /// When a worker last claimed from the beginning, milliseconds since
    /// `started`.
    swept_ms: AtomicI64,
    /// Milliseconds from one sweep to the next: within [`SWEEP`], from the
    /// last sweep's duration (a test may fix it).
    sweep_ms: AtomicI64,
    /// A test fixed the sweep's period.
    sweep_fixed: std::sync::atomic::AtomicBool,
    /// Until when (milliseconds since `started`) a rewind holds the
    /// cursor at the beginning.
    held_until_ms: AtomicI64,
    /// The floor task's readings (one task reads, every 500 ms).
    readings: std::sync::Mutex<Readings>,
    /// The catch-ups so far, for the workers' ordered cursors.
    catch_ups: std::sync::Mutex<CatchUps>,
    started: std::time::Instant,
    /// `pg_locks` of the outbox, as the floor task reads them.
    sql: SqlStr,
}

/// The shared cursor: its key, and how many rewinds it has seen. A claim
/// moves it only if no rewind came between its start and its end.
#[derive(Debug, Default)]
struct Cursor {
    key: Start,
    rewinds: u64,
}

/// One claim's start: where, and the rewinds seen then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim {
    pub(crate) start: Start,
    rewinds: u64,
    /// Begun within a rewind's hold: it does not move the cursor.
    held: bool,
    /// The relay's sweep: it starts at the beginning on its turn.
    sweep: bool,
    /// The floor when it began: one read after the claim could pass a row
    /// that committed in between.
    floor: Option<DateTime<Utc>>,
}

/// What the last reading saw: its clock, and each holder.
#[derive(Debug, Default)]
struct Readings {
    last_us: Option<i64>,
    holders: HashMap<String, Seen>,
}

/// A holder as the readings saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Its rows carry keys from here on (`None`: unknown).
    bound: Option<i64>,
    /// Since when it is known to hold the lock: the first reading that
    /// saw it (its transaction's start at the relay's first reading).
    since_us: i64,
    /// Held for [`LONG`] or more: left out of the floor, for good.
    long: bool,
}

/// What one reading says: the floor (`i64::MIN`: unknown) and, if long
/// holders ended since the last reading, where to catch up from (the
/// earliest of their bounds less [`MARGIN`]; `i64::MIN`: the beginning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reading {
    floor: i64,
    catch_up: Option<i64>,
}

/// Catch-ups: how many so far, and where the last few went back to.
#[derive(Debug, Default)]
struct CatchUps {
    count: u64,
    recent: std::collections::VecDeque<(u64, Start)>,
}

/// One writer of the outbox in a reading: its virtual transaction, and
/// when its transaction began if this role may see it.
type Holder = (String, Option<i64>);

impl Claim {
    /// The floor when the claim began.
    pub(crate) fn floor(&self) -> Option<DateTime<Utc>> {
        self.floor
    }
}

impl Floor {
    pub(crate) fn new(schema: &Ident) -> Self {
        Self {
            at_us: AtomicI64::new(i64::MIN),
            cursor: std::sync::Mutex::new(Cursor::default()),
            swept_ms: AtomicI64::new(0),
            sweep_ms: AtomicI64::new(SWEEP.0.as_millis() as i64),
            sweep_fixed: std::sync::atomic::AtomicBool::new(false),
            held_until_ms: AtomicI64::new(0),
            readings: std::sync::Mutex::new(Readings::default()),
            catch_ups: std::sync::Mutex::new(CatchUps::default()),
            started: std::time::Instant::now(),
            sql: crate::sql::render(include_str!("floor.sql"), schema),
        }
    }

    /// The floor, if known.
    pub(crate) fn get(&self) -> Option<DateTime<Utc>> {
        match self.at_us.load(Ordering::Acquire) {
            i64::MIN => None,
            us => DateTime::from_timestamp_micros(us),
        }
    }

    fn cursor(&self) -> std::sync::MutexGuard<'_, Cursor> {
        self.cursor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows a batch of this relay had claimed are back in the outbox
    /// unsent (its transaction rolled back, or committed with part of
    /// them set aside): the cursor may have passed them (other claims
    /// skipped them while locked). For [`REWIND_HOLD`] every claim starts
    /// at the beginning and none moves the cursor, so that claims which
    /// still saw them locked (a rollback reaches the server a moment after
    /// the batch gave up) cannot move it past them again; no claim begun
    /// before moves it either.
    pub(crate) fn rewind(&self) {
        let mut c = self.cursor();
        c.rewinds += 1;
        c.key = beginning();
        let until = self.started.elapsed().as_millis() as i64 + REWIND_HOLD.as_millis() as i64;
        self.held_until_ms.fetch_max(until, Ordering::AcqRel);
    }

    /// Testing only: how often one worker claims from the beginning.
    #[cfg(feature = "testing")]
    pub(crate) fn set_sweep(&self, every: Duration) {
        self.sweep_fixed.store(true, Ordering::Relaxed);
        self.sweep_ms
            .store(every.as_millis() as i64, Ordering::Relaxed);
    }

    /// The sweep's period when a test fixed it.
    pub(crate) fn fixed_sweep(&self) -> Option<Duration> {
        self.sweep_fixed
            .load(Ordering::Relaxed)
            .then(|| Duration::from_millis(self.sweep_ms.load(Ordering::Relaxed) as u64))
    }

    /// A claim that started at the beginning as a sweep took `took`: the
    /// next sweep comes 50 times that later, within [`SWEEP`].
    pub(crate) fn swept(&self, claim: Claim, took: Duration) {
        if claim.sweep && !self.sweep_fixed.load(Ordering::Relaxed) {
            let pause = (took * SWEEP_PAUSE_PER_COST).clamp(SWEEP.0, SWEEP.1);
            self.sweep_ms
                .store(pause.as_millis() as i64, Ordering::Relaxed);
        }
    }

    /// Where the next claim starts: the cursor, or the beginning when it
    /// is this claim's turn to sweep (one claim of the relay per sweep
    /// period), or while a rewind holds.
    pub(crate) fn start(&self) -> Claim {
        let c = self.cursor();
        let mut claim = Claim {
            start: c.key,
            rewinds: c.rewinds,
            held: false,
            sweep: false,
            floor: self.get(),
        };
        drop(c);
        let now = self.started.elapsed().as_millis() as i64;
        if now < self.held_until_ms.load(Ordering::Acquire) {
            claim.start = beginning();
            claim.held = true;
            return claim;
        }
        let swept = self.swept_ms.load(Ordering::Acquire);
        if now - swept >= self.sweep_ms.load(Ordering::Relaxed)
            && self
                .swept_ms
                .compare_exchange(swept, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            claim.start = beginning();
            claim.sweep = true;
        }
        claim
    }

    /// After `claim`: `last`, the greatest key it claimed (if any). Rows
    /// below it were claimed or are locked by other batches; rows below
    /// the floor (as it was when the claim began) cannot commit any more.
    /// The cursor moves to the earlier of the two, never past the floor
    /// (unknown: back to the beginning).
    /// Another claim may have moved it since: any of their places is true,
    /// the last one written stands.
    pub(crate) fn advance(&self, claim: Claim, last: Option<Key>) {
        let key = bounded(claim.floor, last);
        let mut c = self.cursor();
        if c.rewinds == claim.rewinds && !claim.held {
            c.key = key;
        }
    }

    /// One reading of the clock and the outbox's writers, on `pool`;
    /// whether it caught up (long writers ended).
    pub(crate) async fn read(&self, pool: &PgPool) -> sqlx::Result<bool> {
        let rows: Vec<(i64, Option<String>, Option<i64>)> =
            sqlx::query_as(self.sql.clone()).fetch_all(pool).await?;
        let Some(at_us) = rows.first().map(|r| r.0) else {
            return Ok(false);
        };
        let holders = rows
            .into_iter()
            .filter_map(|(_, h, start)| Some((h?, start)))
            .collect();
        let reading = {
            let mut r = self.readings.lock().unwrap_or_else(|p| p.into_inner());
            r.observe(at_us, holders)
        };
        self.at_us.store(reading.floor, Ordering::Release);
        if let Some(from) = reading.catch_up {
            self.catch_up(from);
        }
        Ok(reading.catch_up.is_some())
    }

    /// Long holders of the floor ended: their rows, with keys from
    /// `from_us` on (`i64::MIN`: anywhere), may have committed below the
    /// cursors. The shared cursor goes back there, and no claim begun
    /// before moves it forward again (as after a rewind, without its
    /// hold: nothing is locked); the workers' ordered cursors go back at
    /// their next claim ([`Floor::catch_ups`]).
    fn catch_up(&self, from_us: i64) {
        let from = DateTime::from_timestamp_micros(from_us).map(|at| (at, Uuid::nil()));
        {
            let mut c = self.cursor();
            c.rewinds += 1;
            c.key = c.key.min(from);
        }
        let mut k = self.catch_ups.lock().unwrap_or_else(|p| p.into_inner());
        k.count += 1;
        let count = k.count;
        k.recent.push_back((count, from));
        if k.recent.len() > CATCH_UPS_KEPT {
            k.recent.pop_front();
        }
    }

    /// The catch-ups after the `seen`th: how many there are now, and where
    /// a cursor that saw only `seen` must go back to (the earliest of
    /// theirs; the beginning if they are no longer all remembered). `None`
    /// when there were none.
    pub(crate) fn catch_ups(&self, seen: u64) -> (u64, Option<Start>) {
        let k = self.catch_ups.lock().unwrap_or_else(|p| p.into_inner());
        if k.count <= seen {
            return (k.count, None);
        }
        let missed = k.recent.iter().filter(|(n, _)| *n > seen);
        let from = if k.recent.front().is_some_and(|(n, _)| *n <= seen + 1) {
            missed.map(|(_, from)| *from).min().flatten()
        } else {
            beginning()
        };
        (k.count, Some(from))
    }
}

impl Readings {
    /// Takes in a reading at `at_us` with these `holders` (each by its
    /// transaction id once it has one, which a `PREPARE TRANSACTION`
    /// keeps). A holder's bound: if it was not in the previous reading,
    /// that reading's clock (it took its lock after); at the relay's first
    /// reading, when its transaction began if this role may see it, else
    /// nothing (another role's, or a prepared transaction): it bounds
    /// nothing until it ends or is long. A holder is long once it has held
    /// the lock for [`LONG`] as the readings saw it (from its transaction's
    /// start at the first reading), and stays so. The floor is the
    /// earliest of the clock and the bounds of the holders that are not
    /// long, less [`MARGIN`]; the long ones that ended since the previous
    /// reading are caught up from.
    fn observe(&mut self, at_us: i64, holders: Vec<Holder>) -> Reading {
        let margin = MARGIN.as_micros() as i64;
        let long = LONG.as_micros() as i64;
        let previous = self.last_us;
        let holders: HashMap<String, Seen> = holders
            .into_iter()
            .map(|(h, began)| {
                let seen = match (self.holders.get(&h), previous) {
                    (Some(s), _) => *s,
                    (None, Some(previous)) => Seen {
                        bound: Some(previous),
                        since_us: at_us,
                        long: false,
                    },
                    (None, None) => Seen {
                        bound: began,
                        since_us: began.unwrap_or(at_us).min(at_us),
                        long: false,
                    },
                };
                let long = seen.long || at_us - seen.since_us >= long;
                (h, Seen { long, ..seen })
            })
            .collect();
        let mut floor = Some(at_us);
        for seen in holders.values().filter(|s| !s.long) {
            floor = match (floor, seen.bound) {
                (Some(f), Some(b)) => Some(f.min(b)),
                _ => None,
            };
        }
        let catch_up = self
            .holders
            .iter()
            .filter(|(h, s)| s.long && !holders.contains_key(*h))
            .map(|(_, s)| s.bound.map_or(i64::MIN, |b| b - margin))
            .min();
        self.last_us = Some(at_us);
        self.holders = holders;
        Reading {
            floor: floor.map_or(i64::MIN, |f| f - margin),
            catch_up,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;

    fn held(h: &str) -> Holder {
        (h.to_owned(), None)
    }

    fn floor_of(r: &mut Readings, at_us: i64, holders: Vec<Holder>) -> i64 {
        let reading = r.observe(at_us, holders);
        assert_eq!(reading.catch_up, None, "no catch-up at {at_us}");
        reading.floor
    }

    #[test]
    fn a_writer_of_unseen_start_at_the_first_reading_leaves_the_floor_unknown_until_it_is_long() {
        let mut r = Readings::default();
        assert_eq!(floor_of(&mut r, 100 * S, vec![held("3/7")]), i64::MIN);
        assert_eq!(floor_of(&mut r, 101 * S, vec![held("3/7")]), i64::MIN);
        // Seen for two seconds: left out, and caught up from the
        // beginning (where its rows are is unknown) when it ends.
        assert_eq!(floor_of(&mut r, 102 * S, vec![held("3/7")]), 101 * S);
        assert_eq!(
            r.observe(103 * S, vec![]),
            Reading {
                floor: 102 * S,
                catch_up: Some(i64::MIN)
            }
        );
    }

    #[test]
    fn a_writer_whose_start_is_seen_bounds_the_floor_from_its_start_until_it_is_long() {
        let mut r = Readings::default();
        let began = vec![("3/7".into(), Some(99 * S + S / 2))];
        assert_eq!(floor_of(&mut r, 100 * S, began.clone()), 98 * S + S / 2);
        assert_eq!(floor_of(&mut r, 101 * S, began.clone()), 98 * S + S / 2);
        assert_eq!(floor_of(&mut r, 102 * S, began), 101 * S, "long");
        assert_eq!(
            r.observe(103 * S, vec![]),
            Reading {
                floor: 102 * S,
                catch_up: Some(98 * S + S / 2)
            },
            "its end: caught up from its start"
        );
        assert_eq!(floor_of(&mut r, 104 * S, vec![]), 103 * S, "once");
    }

    #[test]
    fn a_new_writer_holds_the_floor_at_the_reading_before_it_appeared_until_it_is_long() {
        let mut r = Readings::default();
        assert_eq!(floor_of(&mut r, 100 * S, vec![]), 99 * S);
        assert_eq!(floor_of(&mut r, 101 * S, vec![held("4/1")]), 99 * S);
        assert_eq!(floor_of(&mut r, 101 * S + S / 2, vec![held("4/1")]), 99 * S);
        // Still open a minute later: left out; its rows may carry keys
        // from 100 s on.
        assert_eq!(floor_of(&mut r, 160 * S, vec![held("4/1")]), 159 * S);
        assert_eq!(
            r.observe(161 * S, vec![held("5/2")]),
            Reading {
                floor: 159 * S,
                catch_up: Some(99 * S)
            }
        );
        // A short one ends: the floor held for it, nothing to catch up.
        assert_eq!(floor_of(&mut r, 162 * S, vec![]), 161 * S);
    }

    #[test]
    fn a_long_writer_stays_long_when_the_clock_steps_back_and_is_caught_up_from() {
        let mut r = Readings::default();
        assert_eq!(floor_of(&mut r, 100 * S, vec![]), 99 * S);
        assert_eq!(floor_of(&mut r, 101 * S, vec![held("4/1")]), 99 * S);
        assert_eq!(floor_of(&mut r, 103 * S, vec![held("4/1")]), 102 * S);
        // The clock steps back a second and a half: still left out.
        assert_eq!(
            floor_of(&mut r, 101 * S + S / 2, vec![held("4/1")]),
            100 * S + S / 2
        );
        assert_eq!(r.observe(102 * S, vec![]).catch_up, Some(99 * S));
    }

    #[test]
    fn a_writer_first_seen_after_a_gap_in_the_readings_is_not_long_at_once() {
        let mut r = Readings::default();
        assert_eq!(floor_of(&mut r, 100 * S, vec![]), 99 * S);
        // Readings failed for a minute: its rows may lie from 100 s on,
        // but it has been seen holding the lock for no time at all.
        assert_eq!(floor_of(&mut r, 160 * S, vec![held("4/1")]), 99 * S);
        assert_eq!(floor_of(&mut r, 161 * S, vec![held("4/1")]), 99 * S);
        assert_eq!(floor_of(&mut r, 162 * S, vec![]), 161 * S);
    }

    fn at(secs: i64) -> Key {
        (DateTime::from_timestamp(secs, 0).unwrap(), Uuid::nil())
    }

    fn floor() -> Floor {
        let floor = Floor::new(&Ident::new("schema", "shop").unwrap());
        floor.swept_ms.store(i64::MAX / 2, Ordering::Release);
        floor
    }

    #[test]
    fn the_cursor_stays_at_the_last_key_claimed_below_the_floor_and_never_passes_it() {
        let floor = floor();
        floor.advance(floor.start(), Some(at(50)));
        assert_eq!(
            floor.start().start,
            None,
            "unknown floor: from the beginning"
        );
        floor.at_us.store(100 * S, Ordering::Release);
        let early = (at(50).0, Uuid::max());
        floor.advance(floor.start(), Some(early));
        assert_eq!(floor.start().start, Some(early));
        floor.advance(floor.start(), Some(at(500)));
        assert_eq!(floor.start().start, Some(at(100)));
        floor.advance(floor.start(), None);
        assert_eq!(floor.start().start, Some(at(100)));
    }

    #[test]
    fn a_rewind_sends_the_cursor_back_and_claims_begun_before_it_do_not_move_it() {
        let floor = floor();
        floor.at_us.store(100 * S, Ordering::Release);
        floor.advance(floor.start(), Some(at(60)));
        let before = floor.start();
        assert_eq!(before.start, Some(at(60)));
        floor.rewind();
        floor.advance(before, Some(at(80)));
        // Within the hold: from the beginning, and the cursor stays.
        let held = floor.start();
        assert_eq!(held.start, None);
        floor.advance(held, Some(at(70)));
        assert_eq!(floor.cursor().key, None);
        // After it: claims move it again.
        floor.held_until_ms.store(0, Ordering::Release);
        floor.advance(floor.start(), Some(at(70)));
        assert_eq!(floor.start().start, Some(at(70)));
    }

    #[test]
    fn one_claim_per_sweep_starts_at_the_beginning() {
        let floor = Floor::new(&Ident::new("schema", "shop").unwrap());
        floor.at_us.store(100 * S, Ordering::Release);
        floor.sweep_ms.store(0, Ordering::Relaxed);
        floor.advance(floor.start(), Some(at(60)));
        assert_eq!(floor.start().start, None, "its turn to sweep");
        floor.sweep_ms.store(3_600_000, Ordering::Relaxed);
        assert_eq!(floor.start().start, Some(at(60)));
    }

    #[test]
    fn a_sweep_comes_fifty_times_its_own_cost_later_within_bounds() {
        let floor = Floor::new(&Ident::new("schema", "shop").unwrap());
        let period = |took_ms: u64| {
            floor.sweep_ms.store(0, Ordering::Relaxed);
            floor.swept_ms.store(-1_000_000, Ordering::Release);
            let sweep = floor.start();
            assert!(sweep.sweep);
            floor.swept(sweep, Duration::from_millis(took_ms));
            floor.sweep_ms.load(Ordering::Relaxed)
        };
        assert_eq!(period(2), 1_000, "a healthy index: every second");
        assert_eq!(period(100), 5_000);
        assert_eq!(period(2_000), 30_000, "never rarer than 30 s");
        // A claim that is not the sweep leaves the period alone.
        floor.swept_ms.store(i64::MAX / 2, Ordering::Release);
        let claim = floor.start();
        floor.swept(claim, Duration::from_secs(10));
        assert_eq!(floor.sweep_ms.load(Ordering::Relaxed), 30_000);
    }

    #[test]
    fn a_catch_up_sends_the_cursors_back_once_and_claims_begun_before_do_not_move_them() {
        let floor = floor();
        floor.at_us.store(200 * S, Ordering::Release);
        floor.advance(floor.start(), Some(at(150)));
        let before = floor.start();
        assert_eq!(floor.catch_ups(0), (0, None));
        floor.catch_up(100 * S);
        floor.advance(before, Some(at(180)));
        assert_eq!(floor.start().start, Some(at(100)), "back, and it stays");
        floor.advance(floor.start(), Some(at(170)));
        assert_eq!(floor.start().start, Some(at(170)), "then on again");
        // A catch-up from past the cursor moves it no further.
        floor.advance(floor.start(), Some(at(110)));
        floor.catch_up(120 * S);
        assert_eq!(floor.start().start, Some(at(110)));
        floor.advance(floor.start(), Some(at(170)));
        floor.catch_up(120 * S);
        assert_eq!(floor.start().start, Some(at(120)));
        assert_eq!(floor.catch_ups(0), (3, Some(Some(at(100)))));
        assert_eq!(floor.catch_ups(1), (3, Some(Some(at(120)))));
        assert_eq!(floor.catch_ups(3), (3, None));
        // One from the beginning; and a worker that missed more than are
        // kept goes back to the beginning too.
        floor.catch_up(i64::MIN);
        assert_eq!(floor.catch_ups(3), (4, Some(None)));
        for _ in 0..CATCH_UPS_KEPT {
            floor.catch_up(300 * S);
        }
        assert_eq!(floor.catch_ups(4), (68, Some(Some(at(300)))));
        assert_eq!(floor.catch_ups(3), (68, Some(None)));
    }
}
