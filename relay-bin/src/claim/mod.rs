//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox) in
//! one statement (one round trip): ordered chains of its partitions first
//! ([`ordered`] plans them and reads them back), then unordered events, the
//! oldest first (`batch.sql`).
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

use std::collections::HashMap;

use outbox::Ident;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, Row, SqlStr};
use uuid::Uuid;

use crate::error::Result;
use crate::message::{ClaimedRow, OutboxEvent};
use floor::{Claim, Floor, Key};

/// The claim stage: its statements for one schema, the relay's id (whose
/// leases the ordered claim reads) and the batch size.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    /// `batch.sql`.
    batch: SqlStr,
    /// `unordered.sql`.
    unordered: SqlStr,
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
    /// Per partition, the last aggregate served: the next claim resumes
    /// after it (round robin over aggregates, wrapping at the end).
    pub(crate) cursors: HashMap<i32, (String, String)>,
    /// Expected events per aggregate in a claim (1 to 64): deep aggregates
    /// fill a batch with fewer heads, which costs fewer index descents per
    /// event; one-event aggregates need many heads. Learnt from each claim.
    pub(crate) chain_hint: usize,
    /// The last claim's probe found ordered events in the outbox (or no
    /// claim was made yet): the next claim is `batch.sql` (otherwise
    /// `unordered.sql`).
    pub(crate) ordered_waiting: bool,
}

impl ClaimState {
    /// Worker `worker` of `workers`, with no claim made yet.
    pub(crate) fn new(worker: usize, workers: usize) -> Self {
        Self {
            worker,
            workers,
            cursors: HashMap::new(),
            chain_hint: 1,
            ordered_waiting: true,
        }
    }
}

impl Claims {
    pub(crate) fn new(schema: &Ident, relay: Uuid, batch_size: usize) -> Self {
        Self {
            batch: crate::sql::render(include_str!("batch.sql"), schema),
            unordered: crate::sql::render(include_str!("unordered.sql"), schema),
            relay,
            batch_size,
        }
    }

    /// The claims' texts (`batch.sql` and `unordered.sql`, rendered).
    #[cfg(feature = "testing")]
    pub(crate) fn sql(&self) -> (&str, &str) {
        (self.batch.as_str(), self.unordered.as_str())
    }

    /// Claims one batch in the worker's transaction `conn`, `held`
    /// partitions leased by the relay (`None` before its first lease
    /// round): with `unordered.sql` while the worker's last probe found no
    /// ordered event, otherwise (or when this claim's probe finds some and
    /// nothing else was claimed) with `batch.sql`. Unordered events are
    /// claimed from the relay's cursor on, as `floor` places it. Moves the
    /// worker's cursors and remembers the probe's answer.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        held: Option<usize>,
        state: &mut ClaimState,
        floor: &Floor,
    ) -> Result<Vec<OutboxEvent>> {
        let start = floor.start();
        let began = std::time::Instant::now();
        let claimed = async {
            if !state.ordered_waiting {
                let rows = sqlx::query(self.unordered.clone())
                    .bind(self.batch_size as i64)
                    .bind(start.start.map(|k| k.0))
                    .bind(start.start.map_or(Uuid::nil(), |k| k.1))
                    .fetch_all(&mut *conn)
                    .await?;
                let (waiting, rows) = probed(&rows)?;
                state.ordered_waiting = waiting;
                // Rows this transaction locked would come back from the
                // ordered claim's unordered part too: claim again only if
                // there are none.
                if !waiting || !rows.is_empty() {
                    floor.advance(start, last_unordered(&rows));
                    return Ok(rows.into_iter().map(|r| r.event.into()).collect());
                }
            }
            self.claim_all(conn, held, state, floor, start).await
        }
        .await;
        floor.swept(start, began.elapsed());
        claimed
    }

    /// The due chains of the worker's partitions, then unordered events in
    /// the room they left (a quarter of the batch at least: a large ordered
    /// backlog cannot hold them up): `batch.sql`.
    async fn claim_all(
        &self,
        conn: &mut PgConnection,
        held: Option<usize>,
        state: &mut ClaimState,
        floor: &Floor,
        start: Claim,
    ) -> Result<Vec<OutboxEvent>> {
        let plan = ordered::Plan::new(self.batch_size, held, state);
        let (parts, (types, ids)): (Vec<i32>, (Vec<&str>, Vec<&str>)) = state
            .cursors
            .iter()
            .map(|(p, (t, a))| (*p, (t.as_str(), a.as_str())))
            .unzip();
        let rows = sqlx::query(self.batch.clone())
            .bind(self.relay)
            .bind(state.workers as i32)
            .bind(state.worker as i32)
            .bind(plan.per_partition as i32)
            .bind(&parts)
            .bind(&types)
            .bind(&ids)
            .bind(self.batch_size as i64)
            .bind(plan.scan_per_partition as i32)
            .bind(start.start.map(|k| k.0))
            .bind(start.start.map_or(Uuid::nil(), |k| k.1))
            .fetch_all(conn)
            .await?;
        let (waiting, rows) = probed(&rows)?;
        state.ordered_waiting = waiting;
        floor.advance(start, last_unordered(&rows));
        let (mut ordered, unordered): (Vec<ClaimRow>, Vec<ClaimRow>) =
            rows.into_iter().partition(|r| r.partition.is_some());
        // Chain order: heads in the order the claim walked them, each
        // aggregate's events in sequence (`batch.sql` sorts nothing).
        ordered.sort_by_key(|r| (r.ord, r.event.aggregate_seq));
        let mut events = plan.read_back(ordered, state);
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
    pub(crate) event: ClaimedRow,
    /// When it became due (the unordered claim's key, with its id).
    pub(crate) available_at: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) due: bool,
    pub(crate) partition: Option<i32>,
    pub(crate) ord: Option<i64>,
}
