//! The producer's handle on the outbox: start-up checks, enqueueing
//! (validate, then write by the capture path's writer), commit, wake-up.

use std::sync::Arc;

use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::config::{Capture, OutboxConfig};
use super::statements::ensure_wal_ready;
use super::table::TableWriter;
use super::wal::WalWriter;
use crate::error::Result;
use crate::event::NewEvent;
use crate::migrate::PRODUCER;
use crate::wakeup::{Notifier, Wakeup};
use outbox_core::migrate::ensure_migrated;
use outbox_core::{Ident, wakeup_channel};

/// The producer's handle on the outbox. Cheap to clone; create one per
/// service at start-up.
#[derive(Debug, Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    schema: Ident,
    max_payload_bytes: usize,
    writer: Writer,
    /// With [`Wakeup::AfterCommit`]: the background notifier.
    notifier: Option<Notifier>,
}

/// The capture path's writer.
#[derive(Debug)]
enum Writer {
    /// Rows of the outbox table.
    Table(TableWriter),
    /// Logical decoding messages.
    Wal(WalWriter),
}

impl Outbox {
    /// Validates `config`, checks that the schema is migrated
    /// ([`crate::MigrateError::NotMigrated`] names the command that fixes it) and
    /// that the database orders the aggregate types `config` names.
    /// With [`Wakeup::AfterCommit`] it starts the background notifier, so it
    /// must be called inside a Tokio runtime.
    pub async fn new(pool: &PgPool, config: OutboxConfig) -> Result<Self> {
        let schema = Ident::new("schema", &config.schema)?;
        ensure_migrated(pool, &PRODUCER, &schema).await?;
        crate::ordered_types::ensure(pool, &schema, &config.ordering).await?;
        let channel = wakeup_channel(&schema);
        // The relay reading the slot learns of commits from the log itself.
        let notifier = match (config.capture, config.wakeup) {
            (Capture::Wal, _) => None,
            (Capture::Table, Wakeup::AfterCommit) => Some(Notifier::start(pool, channel.clone())),
            (Capture::Table, Wakeup::InTransaction | Wakeup::PollOnly) => None,
        };
        let writer = match config.capture {
            Capture::Table => Writer::Table(TableWriter::new(
                &schema,
                (config.wakeup == Wakeup::InTransaction).then_some(channel),
            )),
            Capture::Wal => {
                ensure_wal_ready(pool, &schema).await?;
                Writer::Wal(WalWriter::new(&schema))
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                schema,
                max_payload_bytes: config.max_payload_bytes,
                writer,
                notifier,
            }),
        })
    }

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
        match &self.inner.writer {
            Writer::Wal(w) => w.emit_one(conn, event).await,
            Writer::Table(w) => w.insert_one(conn, event).await,
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
        match &self.inner.writer {
            Writer::Wal(w) => w.emit_many(conn, &events).await,
            Writer::Table(w) => w.insert_many(conn, events).await,
        }
    }

    /// How this handle writes events.
    pub fn capture(&self) -> Capture {
        match self.inner.writer {
            Writer::Table(_) => Capture::Table,
            Writer::Wal(_) => Capture::Wal,
        }
    }

    /// The schema this outbox writes to.
    pub fn schema(&self) -> &str {
        self.inner.schema.as_str()
    }

    /// Commits `tx`, then wakes the relay ([`Outbox::wake`]).
    pub async fn commit(&self, tx: Transaction<'_, Postgres>) -> Result<()> {
        tx.commit().await?;
        self.wake();
        Ok(())
    }

    /// Tells relays that events were committed. Call it after committing a
    /// transaction that enqueued events (or use [`Outbox::commit`]). It never
    /// blocks: with [`Wakeup::AfterCommit`] it flags the background notifier,
    /// which coalesces concurrent calls into one NOTIFY sent outside any
    /// producer transaction. With the other modes it does nothing.
    pub fn wake(&self) {
        if let Some(n) = &self.inner.notifier {
            n.wake();
        }
    }
}
