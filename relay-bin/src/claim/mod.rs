//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox),
//! ordered chains of its partitions first ([`ordered`]), then unordered
//! events ([`unordered`]).

pub(crate) mod ordered;
pub(crate) mod unordered;

use std::collections::HashMap;

use outbox::Ident;
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use crate::error::Result;
use crate::message::OutboxEvent;

/// The claim stage: its statements for one schema, the relay's id (whose
/// leases the ordered claim reads) and the batch size.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    /// `unordered.sql`.
    unordered: SqlStr,
    /// `ordered.sql`.
    ordered: SqlStr,
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
            unordered: crate::sql::render(include_str!("unordered.sql"), schema),
            ordered: crate::sql::render(include_str!("ordered.sql"), schema),
            relay,
            batch_size,
        }
    }

    /// Claims one batch in the worker's transaction `conn`, `held`
    /// partitions leased by the relay (`None` before its first lease
    /// round). Unordered events always get a quarter of the batch at
    /// least: a large ordered backlog cannot hold them up.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        held: Option<usize>,
        state: &mut ClaimState,
    ) -> Result<Vec<OutboxEvent>> {
        let batch_size = self.batch_size;
        let mut events = ordered::claim(self, &mut *conn, held, state).await?;
        let room = batch_size
            .saturating_sub(events.len())
            .max(batch_size.div_ceil(4));
        events.extend(unordered::claim(&self.unordered, conn, room).await?);
        Ok(events)
    }
}
