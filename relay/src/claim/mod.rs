//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox) in
//! one statement (one round trip): ordered chains of its partitions first
//! (`batch.sql`; [`ordered`] says which aggregates it asks for, from its
//! walk over the ordered events that became due, `walk.sql`, a round trip
//! of its own before each ordered claim), then unordered events, the
//! oldest first.
//!
//! While no ordered event is waiting, a worker claims with `unordered.sql`
//! instead: the unordered events alone, which spares PostgreSQL planning,
//! starting and locking the ordered part (a claim took 0.21 ms instead of
//! 0.37, medians in sqlx's own timings; docs/BENCHMARKS.md). Both
//! statements carry the same probe, so a worker learns from every claim
//! which of them its next claim needs. A worker starts on `batch.sql`.
//! When `unordered.sql`'s probe finds ordered events, the worker claims
//! with `batch.sql` at once in the same transaction if nothing else was
//! claimed; otherwise the batch goes out with what was claimed (a worker
//! claims again at once after a batch that claimed something), so ordered
//! events that arrive wait one batch of unordered ones (or, should that
//! batch send nothing or fail, the worker's next claim).

pub(crate) mod floor;
pub(crate) mod ordered;

use outbox::Ident;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, Row, SqlStr};
use uuid::Uuid;

use crate::error::Result;
use crate::message::{EventRow, OutboxEvent};
use floor::{Claim, Floor, Key};
use ordered::Ordered;

/// The claim stage: its statements for one schema, the relay's id (whose
/// leases the ordered claim reads) and the batch size.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    /// `batch.sql`.
    batch: SqlStr,
    /// `unordered.sql`.
    unordered: SqlStr,
    /// `walk.sql`.
    walk: SqlStr,
    relay: Uuid,
    batch_size: usize,
}

/// One worker's claim state: its share of the partitions and where its
/// ordered claims resume.
#[derive(Debug)]
pub(crate) struct ClaimState {
    /// Which share of the relay's partitions this worker publishes
    /// (`partition % workers == worker`).
    pub(crate) worker: usize,
    pub(crate) workers: usize,
    /// Its walk, queue and sweep of ordered events.
    pub(crate) ordered: Ordered,
    /// The last claim's probe found ordered events in the outbox (or no
    /// claim was made yet): the next claim is `batch.sql` (otherwise
    /// `unordered.sql`, unless the worker has ordered work queued).
    pub(crate) ordered_waiting: bool,
}

impl ClaimState {
    /// Worker `worker` of `workers`, with no claim made yet.
    pub(crate) fn new(worker: usize, workers: usize) -> Self {
        Self {
            worker,
            workers,
            ordered: Ordered::default(),
            ordered_waiting: true,
        }
    }

    /// The next claim is `batch.sql`.
    pub(crate) fn claims_ordered(&self) -> bool {
        self.ordered_waiting || self.ordered.busy()
    }
}

impl Claims {
    pub(crate) fn new(schema: &Ident, relay: Uuid, batch_size: usize) -> Self {
        Self {
            batch: crate::sql::render(include_str!("batch.sql"), schema),
            unordered: crate::sql::render(include_str!("unordered.sql"), schema),
            walk: crate::sql::render(include_str!("walk.sql"), schema),
            relay,
            batch_size,
        }
    }

    /// The claims' texts (`batch.sql`, `unordered.sql` and `walk.sql`,
    /// rendered).
    #[cfg(feature = "testing")]
    pub(crate) fn sql(&self) -> [&str; 3] {
        [
            self.batch.as_str(),
            self.unordered.as_str(),
            self.walk.as_str(),
        ]
    }

    /// Claims one batch in the worker's transaction `conn`, with the
    /// relay's lease generation and the partitions its last lease round
    /// held (one bit each):
    /// with `unordered.sql` while the worker's last probe found no ordered
    /// event and it has none queued, otherwise (or when this claim's probe
    /// finds some and nothing else was claimed) with `batch.sql`.
    /// Unordered events are claimed from the relay's cursor on, as `floor`
    /// placed it at `start` (taken before the transaction's `BEGIN`, so
    /// the floor it carries is below the transaction's `now()`). Moves the
    /// cursors and remembers the probe's answer.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        (generation, held): (u64, u64),
        state: &mut ClaimState,
        (floor, start): (&Floor, Claim),
    ) -> Result<Vec<OutboxEvent>> {
        let began = std::time::Instant::now();
        let share =
            ordered::mask((0..64).filter(|p| *p as usize % state.workers.max(1) == state.worker));
        state.ordered.leases(generation, held & share);
        state
            .ordered
            .catch_up(floor.catch_ups(state.ordered.caught()));
        state.ordered.fix_sweep(floor.fixed_sweep());
        let claimed = async {
            if !state.claims_ordered() {
                let (from, sweep) = state.ordered.probe_from();
                let rows = sqlx::query(self.unordered.clone())
                    .bind(self.batch_size as i64)
                    .bind(start.start.map(|k| k.0))
                    .bind(start.start.map_or(Uuid::nil(), |k| k.1))
                    .bind(from.map(|k| k.0))
                    .bind(from.map_or(Uuid::nil(), |k| k.1))
                    .fetch_all(&mut *conn)
                    .await?;
                let (waiting, rows) = probed(&rows)?;
                state.ordered_waiting = waiting;
                state
                    .ordered
                    .probed(sweep, waiting, start.floor(), began.elapsed());
                // Rows this transaction locked would come back from the
                // ordered claim's unordered part too: claim again only if
                // there are none.
                if !waiting || !rows.is_empty() {
                    floor.advance(start, last_unordered(&rows));
                    return Ok(rows.into_iter().map(|r| r.event.into()).collect());
                }
            }
            self.claim_all(conn, state, floor, start).await
        }
        .await;
        floor.swept(start, began.elapsed());
        claimed
    }

    /// The walks this claim takes, then the chains of the aggregates
    /// queued and unordered events in the room they left (a quarter of the
    /// batch at least: a large ordered backlog cannot hold them up):
    /// `batch.sql`.
    async fn claim_all(
        &self,
        conn: &mut PgConnection,
        state: &mut ClaimState,
        floor: &Floor,
        start: Claim,
    ) -> Result<Vec<OutboxEvent>> {
        let limit = Ordered::walk_limit(self.batch_size);
        for (walk, from) in state.ordered.walks(self.batch_size) {
            // The floor as it was before the walk's snapshot: one read
            // after could pass a row that committed in between.
            let bound = floor.get();
            let began = std::time::Instant::now();
            let rows = sqlx::query_as(self.walk.clone())
                .bind(self.relay)
                .bind(state.workers as i32)
                .bind(state.worker as i32)
                .bind(from.map(|k| k.0))
                .bind(from.map_or(Uuid::nil(), |k| k.1))
                .bind(limit as i64)
                .fetch_all(&mut *conn)
                .await?;
            state
                .ordered
                .walked(walk, rows, limit, bound, began.elapsed());
        }
        let probe = state.ordered.probe_cursor();
        let (types, ids, after) = state.ordered.request(self.batch_size);
        let rows = sqlx::query(self.batch.clone())
            .bind(self.relay)
            .bind(state.workers as i32)
            .bind(state.worker as i32)
            .bind(&types)
            .bind(&ids)
            .bind(&after)
            .bind(self.batch_size as i64)
            .bind(start.start.map(|k| k.0))
            .bind(start.start.map_or(Uuid::nil(), |k| k.1))
            .bind(probe.map(|k| k.0))
            .bind(probe.map_or(Uuid::nil(), |k| k.1))
            .fetch_all(conn)
            .await?;
        let held: Vec<i32> = match rows.first() {
            Some(row) => row.try_get("held")?,
            None => Vec::new(),
        };
        let (waiting, rows) = probed(&rows)?;
        state.ordered_waiting = waiting;
        floor.advance(start, last_unordered(&rows));
        let (ordered, unordered): (Vec<ClaimRow>, Vec<ClaimRow>) =
            rows.into_iter().partition(|r| r.partition.is_some());
        let mut events = state.ordered.read_back(ordered, &held, self.batch_size);
        events.extend(unordered.into_iter().map(|r| OutboxEvent::from(r.event)));
        Ok(events)
    }
}

/// A claim's rows read: the probe's answer (ordered events are waiting)
/// and the events claimed. Every row carries the answer; a row with a null
/// id is the probe's alone (nothing claimed).
fn probed(rows: &[PgRow]) -> Result<(bool, Vec<ClaimRow>)> {
    let mut waiting = false;
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        waiting |= row.try_get::<bool, _>("ordered_waiting")?;
        if row.try_get::<Option<Uuid>, _>("id")?.is_some() {
            claimed.push(ClaimRow::from_row(row)?);
        }
    }
    Ok((waiting, claimed))
}

/// The greatest key among a claim's unordered rows.
fn last_unordered(rows: &[ClaimRow]) -> Option<Key> {
    rows.iter()
        .filter(|r| r.partition.is_none())
        .filter_map(|r| Some((r.available_at?, r.event.id)))
        .max()
}

/// A claimed row of `batch.sql` or `unordered.sql`: an event as claimed,
/// with whether it is due (the chain of an aggregate stops before its
/// first event that is not) and, for an ordered event, its partition and
/// its head's place in the claim.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimRow {
    #[sqlx(flatten)]
    pub(crate) event: EventRow,
    /// When it became due (the unordered claim's key, with its id).
    pub(crate) available_at: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) due: bool,
    pub(crate) partition: Option<i32>,
    pub(crate) ord: Option<i64>,
}
