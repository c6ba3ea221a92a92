//! The claim stage: a worker locks one batch of due events in its
//! transaction (`FOR UPDATE SKIP LOCKED`, so relays share the outbox),
//! ordered chains of its partitions first ([`ordered`]), then unordered
//! events ([`unordered`]).

pub(crate) mod ordered;
pub(crate) mod unordered;

use outbox::Ident;
use sqlx::{PgConnection, SqlStr};

use crate::error::Result;
use crate::message::ClaimedEvent;
use crate::relay::{BrokerSession, Relay};

/// The claim stage's statements for one schema.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `unordered.sql`.
    pub(crate) unordered: SqlStr,
    /// `ordered.sql`.
    pub(crate) ordered: SqlStr,
}

impl Statements {
    pub(crate) fn new(schema: &Ident) -> Self {
        Self {
            unordered: crate::sql::render(include_str!("unordered.sql"), schema),
            ordered: crate::sql::render(include_str!("ordered.sql"), schema),
        }
    }
}

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
