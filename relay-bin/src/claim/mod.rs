//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox) in
//! one statement (`batch.sql`, one round trip): ordered chains of its
//! partitions first ([`ordered`] plans them and reads them back), then
//! unordered events, the oldest first.

pub(crate) mod ordered;

use std::collections::HashMap;

use outbox::Ident;
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use crate::error::Result;
use crate::message::{ClaimedRow, OutboxEvent};

/// The claim stage: its statement for one schema, the relay's id (whose
/// leases the ordered claim reads) and the batch size.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    /// `batch.sql`.
    batch: SqlStr,
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
}

impl ClaimState {
    /// Worker `worker` of `workers`, with no claim made yet.
    pub(crate) fn new(worker: usize, workers: usize) -> Self {
        Self {
            worker,
            workers,
            cursors: HashMap::new(),
            chain_hint: 1,
        }
    }
}

impl Claims {
    pub(crate) fn new(schema: &Ident, relay: Uuid, batch_size: usize) -> Self {
        Self {
            batch: crate::sql::render(include_str!("batch.sql"), schema),
            relay,
            batch_size,
        }
    }

    /// The claim's text (`batch.sql`, rendered).
    #[cfg(feature = "testing")]
    pub(crate) fn sql(&self) -> &str {
        self.batch.as_str()
    }

    /// Claims one batch in the worker's transaction `conn`, `held`
    /// partitions leased by the relay (`None` before its first lease
    /// round): the due chains of the worker's partitions, then unordered
    /// events in the room they left (a quarter of the batch at least: a
    /// large ordered backlog cannot hold them up). Moves the worker's
    /// cursors.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        held: Option<usize>,
        state: &mut ClaimState,
    ) -> Result<Vec<OutboxEvent>> {
        let plan = ordered::Plan::new(self.batch_size, held, state);
        let (parts, (types, ids)): (Vec<i32>, (Vec<&str>, Vec<&str>)) = state
            .cursors
            .iter()
            .map(|(p, (t, a))| (*p, (t.as_str(), a.as_str())))
            .unzip();
        let rows: Vec<ClaimRow> = sqlx::query_as(self.batch.clone())
            .bind(self.relay)
            .bind(state.workers as i32)
            .bind(state.worker as i32)
            .bind(plan.per_partition as i32)
            .bind(&parts)
            .bind(&types)
            .bind(&ids)
            .bind(self.batch_size as i64)
            .bind(plan.scan_per_partition as i32)
            .fetch_all(conn)
            .await?;
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

/// A row of `batch.sql`: an event as claimed, with whether it is due (the
/// chain of an aggregate stops before its first event that is not) and,
/// for an ordered event, its partition and its head's place in the claim.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimRow {
    #[sqlx(flatten)]
    pub(crate) event: ClaimedRow,
    pub(crate) due: bool,
    pub(crate) partition: Option<i32>,
    pub(crate) ord: Option<i64>,
}
