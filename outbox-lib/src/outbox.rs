use std::collections::BTreeSet;
use std::sync::Arc;

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, SqlSafeStr, SqlStr, Transaction};
use uuid::Uuid;

use crate::error::Result;
use crate::event::NewEvent;
use crate::ident::{Ident, wakeup_channel};
use crate::migrate::{PRODUCER, ensure_migrated};
use crate::wakeup::{Notifier, Wakeup};

/// Default payload limit: 1 MiB, far below RabbitMQ's maximum message size
/// (128 MiB by default) and small enough that one event never stalls a
/// relay batch.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// Which events are published in per-aggregate commit order
/// (`docs/ORDERING.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ordering {
    /// No ordering (default): events are published as soon as possible, in
    /// any order, by any relay worker.
    #[default]
    None,
    /// Every event is ordered within its aggregate.
    All,
    /// Events of these aggregate types are ordered; the rest are not.
    Types(BTreeSet<String>),
}

impl Ordering {
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

/// Settings of an [`Outbox`] handle.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    schema: String,
    max_payload_bytes: usize,
    wakeup: Wakeup,
    ordering: Ordering,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            wakeup: Wakeup::default(),
            ordering: Ordering::None,
        }
    }
}

impl OutboxConfig {
    /// The schema holding the outbox tables (default `public`). Validated by
    /// [`Outbox::new`]: `[a-z_][a-z0-9_]*`, at most 56 characters.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Largest accepted payload, in bytes of JSON text (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`]).
    pub fn max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// How relays learn of new events (default [`Wakeup::AfterCommit`]).
    pub fn wakeup(mut self, wakeup: Wakeup) -> Self {
        self.wakeup = wakeup;
        self
    }

    /// Which events keep their per-aggregate commit order through the relay
    /// (default [`Ordering::None`]). An ordered event takes the next number
    /// of its aggregate (`outbox_sequences`), holding that row's lock until
    /// the transaction ends: transactions writing events of the same
    /// aggregate commit one after the other. See `docs/ORDERING.md`.
    pub fn ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
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
    insert_one_ordered: SqlStr,
    give_back_seq: SqlStr,
    insert_many: SqlStr,
    insert_many_returning: SqlStr,
    number_many: SqlStr,
    ordering: Ordering,
    channel: String,
    wakeup: Wakeup,
    notifier: Option<Notifier>,
}

impl Outbox {
    /// Validates `config` and checks that the schema is migrated
    /// ([`crate::Error::NotMigrated`] names the command that fixes it).
    /// With [`Wakeup::AfterCommit`] it starts the background notifier, so it
    /// must be called inside a Tokio runtime.
    pub async fn new(pool: &PgPool, config: OutboxConfig) -> Result<Self> {
        let schema = Ident::new("schema", &config.schema)?;
        ensure_migrated(pool, &PRODUCER, &schema).await?;
        let channel = wakeup_channel(&schema);
        let notifier = match config.wakeup {
            Wakeup::AfterCommit => Some(Notifier::start(pool, channel.clone())),
            Wakeup::InTransaction | Wakeup::PollOnly => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                insert_one: insert_one_sql(&schema),
                insert_one_ordered: insert_one_ordered_sql(&schema),
                give_back_seq: give_back_seq_sql(&schema),
                insert_many: insert_many_sql(&schema, ""),
                insert_many_returning: insert_many_sql(&schema, " RETURNING id"),
                number_many: number_many_sql(&schema),
                ordering: config.ordering,
                schema,
                max_payload_bytes: config.max_payload_bytes,
                channel,
                wakeup: config.wakeup,
                notifier,
            }),
        })
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
    /// returns the same id.
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
        let ordered = self.inner.ordering.applies_to(&event.aggregate_type);
        // A plain VALUES insert: cheaper for the database than the unnest
        // form for one row (measured: about 20% more producer
        // transactions per second with 8 writers).
        let sql = if ordered {
            &self.inner.insert_one_ordered
        } else {
            &self.inner.insert_one
        };
        let inserted = sqlx::query(sql.clone())
            .bind(event.id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(serde_json::Value::Object(event.headers).to_string())
            .bind(&event.exchange)
            .bind(&event.routing_key)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if ordered && inserted == 0 {
            // The id was already there: hand the number back, or the
            // aggregate's sequence would have a hole consumers wait on. This
            // transaction holds the counter's row lock since it took the
            // number, so nobody took a later one.
            sqlx::query(self.inner.give_back_seq.clone())
                .bind(&event.aggregate_type)
                .bind(&event.aggregate_id)
                .execute(&mut *conn)
                .await?;
        }
        self.notify_in_transaction(conn).await?;
        Ok(event.id)
    }

    /// Writes many events in the caller's transaction with **one** statement
    /// whatever their number (array binds, constant SQL text); a second one
    /// numbers the ordered events among them, if any. Returns the ids in
    /// input order. Every event is validated before anything is written, so
    /// an error leaves the transaction untouched. Ordered events of one
    /// aggregate are numbered in input order.
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
        let n = events.len();
        let mut ids = Vec::with_capacity(n);
        let mut agg_types = Vec::with_capacity(n);
        let mut agg_ids = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut exchanges = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut ordered = Vec::new();
        for e in events {
            if self.inner.ordering.applies_to(&e.aggregate_type) {
                ordered.push(e.id);
            }
            ids.push(e.id);
            agg_types.push(e.aggregate_type);
            agg_ids.push(e.aggregate_id);
            types.push(e.event_type);
            payloads.push(e.payload);
            headers.push(serde_json::Value::Object(e.headers).to_string());
            exchanges.push(e.exchange);
            keys.push(e.routing_key);
        }
        let insert = if ordered.is_empty() {
            &self.inner.insert_many
        } else {
            &self.inner.insert_many_returning
        };
        let inserted: Vec<Uuid> = sqlx::query_scalar(insert.clone())
            .bind(&ids)
            .bind(&agg_types)
            .bind(&agg_ids)
            .bind(&types)
            .bind(&payloads)
            .bind(&headers)
            .bind(&exchanges)
            .bind(&keys)
            .fetch_all(&mut *conn)
            .await?;
        if !ordered.is_empty() {
            // Numbered after the insert, and only the rows it inserted (an
            // id already in the outbox must not take a number). The rows are
            // this transaction's own, invisible to relays until commit.
            let inserted: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
            ordered.retain(|id| inserted.contains(id));
            if !ordered.is_empty() {
                sqlx::query(self.inner.number_many.clone())
                    .bind(&ordered)
                    .bind(&ids)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        self.notify_in_transaction(conn).await?;
        Ok(ids)
    }

    async fn notify_in_transaction(&self, conn: &mut PgConnection) -> Result<()> {
        if self.inner.wakeup == Wakeup::InTransaction {
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

// The schema is a validated `Ident`; everything else is bound.
fn insert_one_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8)
         ON CONFLICT (id) DO NOTHING",
        schema.quoted()
    ))
    .into_sql_str()
}

/// Takes the aggregate's next number and inserts the event with it, in one
/// statement. The counter's row lock is held until commit.
fn insert_one_ordered_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "WITH seq AS (
             INSERT INTO {s}.outbox_sequences AS q (aggregate_type, aggregate_id, last_seq)
             VALUES ($2, $3, 1)
             ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = q.last_seq + 1
             RETURNING last_seq)
         INSERT INTO {s}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, aggregate_seq)
         SELECT $1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8, seq.last_seq FROM seq
         ON CONFLICT (id) DO NOTHING"
    ))
    .into_sql_str()
}

fn give_back_seq_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "UPDATE {}.outbox_sequences SET last_seq = last_seq - 1
         WHERE aggregate_type = $1 AND aggregate_id = $2",
        schema.quoted()
    ))
    .into_sql_str()
}

/// Numbers the ordered rows `enqueue_many` just inserted (`$1`: their ids,
/// as its RETURNING gave them), per aggregate in input order (an id given
/// twice counts once, at its first position) (`$2`: every id, in input order).
/// Counters are taken in key order, so two producers cannot deadlock on
/// them.
fn number_many_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "WITH mine AS (
             SELECT DISTINCT ON (o.id) o.id, o.aggregate_type, o.aggregate_id, i.ord
             FROM unnest($2::uuid[]) WITH ORDINALITY AS i(id, ord)
             JOIN {s}.outbox o ON o.id = i.id
             WHERE i.id = ANY($1)
             ORDER BY o.id, i.ord),
         counts AS (
             SELECT aggregate_type, aggregate_id, count(*) AS n FROM mine
             GROUP BY aggregate_type, aggregate_id),
         seq AS (
             INSERT INTO {s}.outbox_sequences AS q (aggregate_type, aggregate_id, last_seq)
             SELECT aggregate_type, aggregate_id, n FROM counts ORDER BY aggregate_type, aggregate_id
             ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = q.last_seq + EXCLUDED.last_seq
             RETURNING aggregate_type, aggregate_id, last_seq),
         numbered AS (
             SELECT m.id, s.last_seq - c.n
                    + row_number() OVER (PARTITION BY m.aggregate_type, m.aggregate_id ORDER BY m.ord) AS seq
             FROM mine m
             JOIN counts c USING (aggregate_type, aggregate_id)
             JOIN seq s USING (aggregate_type, aggregate_id))
         UPDATE {s}.outbox o SET aggregate_seq = numbered.seq FROM numbered WHERE o.id = numbered.id"
    ))
    .into_sql_str()
}

fn insert_many_sql(schema: &Ident, returning: &str) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange, routing_key
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
              AS e(id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         ON CONFLICT (id) DO NOTHING{returning}",
        schema.quoted()
    ))
    .into_sql_str()
}
