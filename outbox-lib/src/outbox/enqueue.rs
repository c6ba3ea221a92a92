//! Enqueueing: validate events, then write them in the caller's
//! transaction by the handle's capture path.

use sqlx::PgConnection;
use uuid::Uuid;

use super::config::Capture;
use super::handle::Outbox;
use crate::error::Result;
use crate::event::NewEvent;

impl Outbox {
    /// Writes one event in the caller's transaction and returns its id.
    ///
    /// The row commits or rolls back with the caller's transaction: an event
    /// of a transaction that rolls back is never published. Enqueueing an id
    /// that is still in the outbox is a no-op (the first write wins) and
    /// returns the same id. With [`Capture::Wal`] the event is a logical
    /// decoding message instead of a row, with the same commit-or-nothing
    /// rule (an id written twice is then published twice).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, outbox: outbox::Outbox) -> anyhow::Result<()> {
    /// use outbox::NewEvent;
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("INSERT INTO orders (id, sku) VALUES ($1, $2)")
    ///     .bind("o-42").bind("A-1")
    ///     .execute(&mut *tx).await?;
    /// let id = outbox
    ///     .enqueue(&mut *tx, NewEvent::new("order", "o-42", "OrderPlaced", &serde_json::json!({"sku": "A-1"}))?)
    ///     .await?;
    /// outbox.commit(tx).await?; // commits, then wakes the relay
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn enqueue(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid> {
        event.validate(self.inner.max_payload_bytes)?;
        match self.inner.capture {
            Capture::Wal => self.emit_one(conn, event).await,
            Capture::Table => self.insert_one(conn, event).await,
        }
    }

    /// Writes many events in the caller's transaction with **one** statement
    /// whatever their number (array binds, constant SQL text). Returns the
    /// ids in input order. Every event is validated before anything is
    /// written, so an error leaves the transaction untouched. Ordered
    /// events of one aggregate are numbered in input order; rows go in
    /// aggregate key order, so two producers writing events of the same
    /// aggregates take their counters in one order and cannot deadlock.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<Uuid>> {
        let events: Vec<NewEvent> = events.into_iter().collect();
        for e in &events {
            e.validate(self.inner.max_payload_bytes)?;
        }
        if events.is_empty() {
            return Ok(Vec::new());
        }
        match self.inner.capture {
            Capture::Wal => self.emit_many(conn, &events).await,
            Capture::Table => self.insert_many(conn, events).await,
        }
    }
}
