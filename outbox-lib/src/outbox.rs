use std::collections::BTreeSet;
use std::sync::Arc;

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, SqlSafeStr, SqlStr, Transaction};
use uuid::Uuid;

use crate::error::Result;
use crate::event::NewEvent;
use crate::migrate::PRODUCER;
use crate::wakeup::{Notifier, Wakeup};
use outbox_core::migrate::ensure_migrated;
use outbox_core::{Ident, wakeup_channel};

/// Default payload limit: 1 MiB, far below RabbitMQ's maximum message size
/// (128 MiB by default) and small enough that one event never stalls a
/// relay batch.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// Which events are published in per-aggregate commit order
/// ([`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderedAggregates {
    /// No ordering (default): events are published as soon as possible, in
    /// any order, by any relay worker.
    #[default]
    None,
    /// Every event is ordered within its aggregate.
    All,
    /// Events of these aggregate types are ordered; the rest are not.
    Types(BTreeSet<String>),
}

impl OrderedAggregates {
    /// Ordering for the named aggregate types only.
    pub fn types<I, S>(types: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::Types(types.into_iter().map(Into::into).collect())
    }

    /// Whether events of `aggregate_type` are ordered.
    pub fn applies_to(&self, aggregate_type: &str) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Types(t) => t.contains(aggregate_type),
        }
    }
}

/// How an [`Outbox`] writes events: which capture path the relay reads
/// them from ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).
/// The AMQP message, the consumer and every guarantee are the same for both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Capture {
    /// A row in the outbox table (default): any relay mode publishes it,
    /// and services in any language can insert rows directly.
    #[default]
    Table,
    /// A transactional logical decoding message in the write-ahead log
    /// (SQL function `outbox_emit`): no table row, no index, no vacuum;
    /// decoded only if the transaction commits, in commit order. Needs
    /// `wal_level = logical` and the schema's replication slot
    /// (`outbox-relay migrate --capture wal`), which [`Outbox::new`]
    /// checks, and a relay running `--capture wal`. An id written twice is
    /// published twice (no primary key to absorb it; consumers dedup).
    Wal,
}

/// Settings of an [`Outbox`] handle.
///
/// Like every configuration of the toolkit: start from
/// [`OutboxConfig::default()`], assign the fields you change; [`Outbox::new`]
/// validates the result.
///
/// ```
/// use outbox::{OrderedAggregates, OutboxConfig};
/// let mut config = OutboxConfig::default();
/// config.schema = "shop".into();
/// config.ordering = OrderedAggregates::types(["order"]);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxConfig {
    /// The schema holding the outbox tables (default `public`). Validated by
    /// [`Outbox::new`]: `[a-z_][a-z0-9_]*`, at most 56 characters.
    pub schema: String,
    /// Largest accepted payload, in bytes of JSON text (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`]).
    pub max_payload_bytes: usize,
    /// How relays learn of new events (default [`Wakeup::AfterCommit`]).
    pub wakeup: Wakeup,
    /// Aggregate types this service relies on being ordered (default
    /// [`OrderedAggregates::None`]: whatever the database says). Ordering is a
    /// property of the data, not of a handle: the database numbers every
    /// writer's events of an ordered type ([`crate::set_ordered`],
    /// `outbox-relay ordering add`), with or without this setting;
    /// [`Outbox::new`] checks that it orders the types named here and
    /// fails with [`crate::Error::OrderingNotRegistered`] otherwise. An
    /// ordered event takes the next number of its aggregate
    /// (`outbox_sequences`), holding that row's lock until the transaction
    /// ends: transactions writing events of the same aggregate commit one
    /// after the other. See [`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md).
    pub ordering: OrderedAggregates,
    /// Where events go (default [`Capture::Table`]).
    pub capture: Capture,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            wakeup: Wakeup::default(),
            ordering: OrderedAggregates::None,
            capture: Capture::Table,
        }
    }
}

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
    insert_one: SqlStr,
    insert_many: SqlStr,
    channel: String,
    wakeup: Wakeup,
    notifier: Option<Notifier>,
    capture: Capture,
    /// The logical decoding messages' prefix ([`Capture::Wal`]).
    prefix: String,
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
        if self.inner.capture == Capture::Wal {
            let written = sqlx::query(self.inner.insert_one.clone())
                .bind(&self.inner.prefix)
                .bind(wal_head(&event))
                .bind(&event.aggregate_type)
                .bind(&event.aggregate_id)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.wal_error(e))?;
            if written.rows_affected() != 1 {
                return Err(self.not_readable(conn).await);
            }
            return Ok(event.id);
        }
        // A plain VALUES insert: cheaper for the database than the unnest
        // form for one row (measured: about 20% more producer
        // transactions per second with 8 writers). The database numbers an
        // event of an ordered type (trigger `outbox_number_ordered`); an id
        // already in the outbox takes no number.
        sqlx::query(self.inner.insert_one.clone())
            .bind(event.id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(serde_json::Value::Object(event.headers).to_string())
            .bind(&event.exchange)
            .bind(&event.routing_key)
            .execute(&mut *conn)
            .await?;
        self.notify_in_transaction(conn).await?;
        Ok(event.id)
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
        if self.inner.capture == Capture::Wal {
            let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
            let heads: Vec<String> = events.iter().map(wal_head).collect();
            let (types, aggregates): (Vec<&str>, Vec<&str>) = events
                .iter()
                .map(|e| (e.aggregate_type.as_str(), e.aggregate_id.as_str()))
                .unzip();
            let written = sqlx::query(self.inner.insert_many.clone())
                .bind(&self.inner.prefix)
                .bind(&heads)
                .bind(&types)
                .bind(&aggregates)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.wal_error(e))?;
            if written.rows_affected() != ids.len() as u64 {
                return Err(self.not_readable(conn).await);
            }
            return Ok(ids);
        }
        let n = events.len();
        let mut ids = Vec::with_capacity(n);
        let mut agg_types = Vec::with_capacity(n);
        let mut agg_ids = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut exchanges = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        for e in events {
            ids.push(e.id);
            agg_types.push(e.aggregate_type);
            agg_ids.push(e.aggregate_id);
            types.push(e.event_type);
            payloads.push(e.payload);
            headers.push(serde_json::Value::Object(e.headers).to_string());
            exchanges.push(e.exchange);
            keys.push(e.routing_key);
        }
        sqlx::query(self.inner.insert_many.clone())
            .bind(&ids)
            .bind(&agg_types)
            .bind(&agg_ids)
            .bind(&types)
            .bind(&payloads)
            .bind(&headers)
            .bind(&exchanges)
            .bind(&keys)
            .execute(&mut *conn)
            .await?;
        self.notify_in_transaction(conn).await?;
        Ok(ids)
    }

    async fn notify_in_transaction(&self, conn: &mut PgConnection) -> Result<()> {
        if self.inner.wakeup == Wakeup::InTransaction && self.inner.capture == Capture::Table {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(&self.inner.channel)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// Commits `tx`, then wakes the relay ([`Outbox::wake`]).
    pub async fn commit(&self, tx: Transaction<'_, Postgres>) -> Result<()> {
        tx.commit().await?;
        self.wake();
        Ok(())
    }

    /// A write to the log refused because nothing would read it
    /// (`outbox_wal_ready`: the slot was dropped or invalidated since
    /// [`Outbox::new`]) is [`crate::Error::WalCaptureNotReady`].
    fn wal_error(&self, e: sqlx::Error) -> crate::Error {
        not_ready(&self.inner.schema, e)
    }

    /// The statement wrote nothing: no slot would read it
    /// (`outbox_wal_readable` has no row). Asks `outbox_wal_ready` why,
    /// which raises and so aborts the caller's transaction: its business
    /// writes cannot commit without their event.
    async fn not_readable(&self, conn: &mut PgConnection) -> crate::Error {
        let why = sqlx::query(AssertSqlSafe(format!(
            "SELECT {}.outbox_wal_ready()",
            self.inner.schema.quoted()
        )))
        .execute(&mut *conn)
        .await;
        match why {
            Err(e) => self.wal_error(e),
            // Readable again this instant: nothing was written all the same.
            Ok(_) => crate::Error::WalCaptureNotReady {
                schema: self.inner.schema.to_string(),
                reason: "the replication slot was not readable when the event was written (it is now); nothing was written, retry the transaction".to_owned(),
            },
        }
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

/// [`Capture::Wal`] writes into nothing unless the database decodes the
/// log and the schema's slot exists: refuse it at start-up instead (every
/// write checks the slot again: `outbox_wal_ready`).
async fn ensure_wal_ready(pool: &PgPool, schema: &Ident) -> Result<()> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await?;
    if wal_level != "logical" {
        return Err(crate::Error::WalCaptureNotReady {
            schema: schema.to_string(),
            reason: format!("the database's wal_level is {wal_level:?}, not \"logical\""),
        });
    }
    sqlx::query(AssertSqlSafe(format!(
        "SELECT {}.outbox_wal_ready()",
        schema.quoted()
    )))
    .execute(pool)
    .await
    .map_err(|e| not_ready(schema, e))?;
    Ok(())
}

/// `outbox_wal_ready`'s refusal (SQLSTATE 55000) as
/// [`crate::Error::WalCaptureNotReady`]; other errors as they are.
fn not_ready(schema: &Ident, e: sqlx::Error) -> crate::Error {
    let refusal = e
        .as_database_error()
        .filter(|d| d.code().as_deref() == Some("55000"))
        .map(|d| d.message().to_owned());
    match refusal {
        Some(message) => {
            let prefix = format!("write-ahead-log capture of schema {schema}: ");
            crate::Error::WalCaptureNotReady {
                schema: schema.to_string(),
                reason: message.strip_prefix(&prefix).unwrap_or(&message).to_owned(),
            }
        }
        None => crate::Error::Database(e),
    }
}

/// The message content of `event` (the contract in docs/WAL_CAPTURE.md),
/// up to and including `"created_at":`: the statement adds the
/// transaction's time, the aggregate's next number when its type is
/// ordered, and the closing brace. The payload goes as the producer's JSON
/// text (validated, not re-normalised).
fn wal_head(event: &NewEvent) -> String {
    let text = |s: &str| serde_json::Value::from(s).to_string();
    let optional = |s: &Option<String>| s.as_deref().map_or("null".to_owned(), text);
    format!(
        r#"{{"v":1,"id":"{}","aggregate_type":{},"aggregate_id":{},"event_type":{},"payload":{},"headers":{},"exchange":{},"routing_key":{},"created_at":"#,
        event.id,
        text(&event.aggregate_type),
        text(&event.aggregate_id),
        text(&event.event_type),
        event.payload,
        serde_json::Value::Object(event.headers.clone()),
        optional(&event.exchange),
        optional(&event.routing_key),
    )
}

/// The tail `outbox_emit` also writes: the time, the sequence of an
/// ordered aggregate (`$3` type, `$4` id, or a row's columns), the brace.
fn wal_tail(s: &str, aggregate_type: &str, aggregate_id: &str) -> String {
    format!(
        "to_json(now())::text
         || CASE WHEN EXISTS (SELECT 1 FROM {s}.outbox_ordered_types t
                              WHERE t.aggregate_type IN ({aggregate_type}, '*'))
                 THEN ',\"aggregate_seq\":' || {s}.outbox_next_seq({aggregate_type}, {aggregate_id})
                 ELSE '' END
         || '}}'"
    )
}

// The schema is a validated `Ident`; everything else is bound. One plain
// statement per event, no function call unless the type is ordered:
// measured cheaper for producers than calling `outbox_emit`. The slot is
// checked in the same statement (`outbox_wal_readable`, a one-time
// filter: no row written when nothing would read it; the caller then asks
// `outbox_wal_ready` why, which aborts the transaction).
fn emit_one_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "SELECT pg_logical_emit_message(true, $1, $2 || {}) WHERE EXISTS (SELECT 1 FROM {s}.outbox_wal_readable)",
        wal_tail(&s, "$3", "$4")
    ))
    .into_sql_str()
}

/// In aggregate key order (input order within an aggregate), like the
/// insert: ordered aggregates' counters are taken in one order by every
/// writer. A sorted subquery is never flattened, so the messages are
/// emitted in that order.
fn emit_many_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "SELECT pg_logical_emit_message(true, $1, e.head || {})
         FROM (SELECT * FROM unnest($2::text[], $3::text[], $4::text[])
                    WITH ORDINALITY AS e(head, aggregate_type, aggregate_id, n)
               ORDER BY aggregate_type, aggregate_id, n) e
         WHERE EXISTS (SELECT 1 FROM {s}.outbox_wal_readable)",
        wal_tail(&s, "e.aggregate_type", "e.aggregate_id")
    ))
    .into_sql_str()
}

fn insert_one_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8)
         ON CONFLICT (id) DO NOTHING",
        schema.quoted()
    ))
    .into_sql_str()
}

fn insert_many_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange, routing_key
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
              WITH ORDINALITY AS e(id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, n)
         ORDER BY aggregate_type, aggregate_id, n
         ON CONFLICT (id) DO NOTHING",
        schema.quoted()
    ))
    .into_sql_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_message_head_is_json_whatever_the_fields_hold() {
        let event = NewEvent::from_json(
            "order \"x\"",
            "o\n1\\",
            "Placed\u{1F600}",
            r#"{"a": [1, {"b": null}]}"#,
        )
        .unwrap()
        .header("traceparent", "00-abc")
        .exchange("ex")
        .with_id(Uuid::nil());
        let text = format!("{}\"2026-12-01T10:00:00+00:00\"}}", wal_head(&event));
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert_eq!(v["v"], 1);
        assert_eq!(v["id"], Uuid::nil().to_string());
        assert_eq!(v["aggregate_type"], "order \"x\"");
        assert_eq!(v["aggregate_id"], "o\n1\\");
        assert_eq!(v["event_type"], "Placed\u{1F600}");
        assert_eq!(v["payload"], serde_json::json!({"a": [1, {"b": null}]}));
        assert_eq!(v["headers"], serde_json::json!({"traceparent": "00-abc"}));
        assert_eq!(v["exchange"], "ex");
        assert_eq!(v["routing_key"], serde_json::Value::Null);
        assert_eq!(v["created_at"], "2026-12-01T10:00:00+00:00");
    }
}
