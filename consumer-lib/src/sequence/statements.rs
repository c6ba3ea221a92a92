//! The `inbox_sequences` statements: lock a batch's aggregates and read
//! their last applied numbers, then record the numbers the batch moved.

use outbox::Ident;
use outbox_core::sql::render;
use sqlx::{PgConnection, SqlStr};

use super::position::{Aggregate, Position};
use super::sequencer::{Locked, Sequencer};

/// The `inbox_sequences` statements of one schema and consumer name.
#[derive(Debug, Clone)]
pub(crate) struct Sequences {
    consumer: String,
    accept_first_seen: bool,
    /// Locks the rows of a batch's aggregates, creating missing ones at
    /// 0, and returns their last applied sequence numbers. Rows are
    /// inserted (and so locked) in the order of the arrays, which the
    /// caller sorts: two instances locking overlapping sets cannot
    /// deadlock. `xmax = 0` marks a row this statement created.
    lock: SqlStr,
    /// Raises `last_seq` of rows this transaction holds locked.
    advance: SqlStr,
}

impl Sequences {
    pub(crate) fn new(schema: &Ident, consumer: &str, accept_first_seen: bool) -> Self {
        Self {
            consumer: consumer.to_owned(),
            accept_first_seen,
            lock: render(include_str!("lock.sql"), schema),
            advance: render(include_str!("advance.sql"), schema),
        }
    }

    /// Locks the aggregates of `positions` (the batch's fresh sequenced
    /// events, in delivery order) until the transaction ends and returns
    /// their state; `None` when there are none (no statement is sent).
    pub(crate) async fn lock<'p>(
        &self,
        conn: &mut PgConnection,
        positions: impl Iterator<Item = &'p Position> + Clone,
    ) -> sqlx::Result<Option<Sequencer>> {
        let mut aggregates: Vec<&Aggregate> = positions.clone().map(|p| &p.aggregate).collect();
        if aggregates.is_empty() {
            return Ok(None);
        }
        aggregates.sort_unstable();
        aggregates.dedup();
        let kinds: Vec<&str> = aggregates.iter().map(|a| a.kind.as_str()).collect();
        let ids: Vec<&str> = aggregates.iter().map(|a| a.id.as_str()).collect();
        let rows: Vec<(String, String, i64, bool)> = sqlx::query_as(self.lock.clone())
            .bind(&self.consumer)
            .bind(&kinds)
            .bind(&ids)
            .fetch_all(conn)
            .await?;
        let rows = rows.into_iter().map(|(kind, id, last, created)| Locked {
            aggregate: Aggregate { kind, id },
            last,
            created,
        });
        Ok(Some(Sequencer::new(
            rows,
            self.accept_first_seen,
            positions,
        )))
    }

    /// Records the sequence numbers `order` moved, in the caller's
    /// transaction (the one holding the locks, with the effects).
    pub(crate) async fn advance(
        &self,
        conn: &mut PgConnection,
        order: &Sequencer,
    ) -> sqlx::Result<()> {
        let moved = order.moved();
        if moved.is_empty() {
            return Ok(());
        }
        let kinds: Vec<&str> = moved.iter().map(|(a, _)| a.kind.as_str()).collect();
        let ids: Vec<&str> = moved.iter().map(|(a, _)| a.id.as_str()).collect();
        let seqs: Vec<i64> = moved.iter().map(|&(_, s)| s).collect();
        sqlx::query(self.advance.clone())
            .bind(&self.consumer)
            .bind(&kinds)
            .bind(&ids)
            .bind(&seqs)
            .execute(conn)
            .await?;
        Ok(())
    }
}
