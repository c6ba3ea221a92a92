//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox),
//! ordered chains of its partitions first ([`ordered`]), then unordered
//! events ([`unordered`]).

pub(crate) mod ordered;
pub(crate) mod unordered;

use sqlx::PgConnection;

use crate::error::Result;
use crate::message::ClaimedEvent;
use crate::relay::{BrokerSession, Relay};

/// Columns every claim returns, in this order.
pub(crate) const CLAIM_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     headers::text AS headers, exchange, routing_key, created_at, attempts, aggregate_seq";

impl Relay {
    /// Claims one batch in the worker's transaction `conn`. Unordered
    /// events always get a quarter of the batch at least: a large ordered
    /// backlog cannot hold them up.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        session: &mut BrokerSession,
    ) -> Result<Vec<ClaimedEvent>> {
        let batch_size = self.inner.config.batch_size;
        let mut events = ordered::claim(&self.inner, &mut *conn, session).await?;
        let room = batch_size
            .saturating_sub(events.len())
            .max(batch_size.div_ceil(4));
        events.extend(unordered::claim(&self.inner, conn, room).await?);
        Ok(events)
    }
}
