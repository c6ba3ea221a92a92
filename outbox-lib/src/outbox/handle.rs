//! The producer's handle on the outbox: start-up checks, commit, wake-up.

use std::sync::Arc;

use sqlx::{PgPool, Postgres, SqlStr, Transaction};

use super::config::{Capture, OutboxConfig};
use super::statements::{
    emit_many_sql, emit_one_sql, ensure_wal_ready, insert_many_sql, insert_one_sql,
};
use crate::error::Result;
use crate::migrate::PRODUCER;
use crate::wakeup::{Notifier, Wakeup};
use outbox_core::migrate::ensure_migrated;
use outbox_core::{Ident, wakeup_channel};

/// The producer's handle on the outbox. Cheap to clone; create one per
/// service at start-up.
#[derive(Debug, Clone)]
pub struct Outbox {
    pub(super) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) schema: Ident,
    pub(super) max_payload_bytes: usize,
    /// The one-event statement of the capture path: a row insert or a
    /// log message.
    pub(super) insert_one: SqlStr,
    /// The many-events statement of the capture path (array binds).
    pub(super) insert_many: SqlStr,
    pub(super) channel: String,
    pub(super) wakeup: Wakeup,
    pub(super) notifier: Option<Notifier>,
    pub(super) capture: Capture,
    /// The logical decoding messages' prefix ([`Capture::Wal`]).
    pub(super) prefix: String,
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
        let (insert_one, insert_many) = match config.capture {
            Capture::Table => (insert_one_sql(&schema), insert_many_sql(&schema)),
            Capture::Wal => {
                ensure_wal_ready(pool, &schema).await?;
                (emit_one_sql(&schema), emit_many_sql(&schema))
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                insert_one,
                insert_many,
                prefix: outbox_core::wal_message_prefix(&schema),
                schema,
                max_payload_bytes: config.max_payload_bytes,
                channel,
                wakeup: config.wakeup,
                notifier,
                capture: config.capture,
            }),
        })
    }

    /// How this handle writes events.
    pub fn capture(&self) -> Capture {
        self.inner.capture
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
