//! The producer's write path: the order transaction of `examples/orders`
//! grown to what a service runs (lock the customer, take stock, the order
//! and its lines), with and without its `OrderPlaced` event (500 bytes),
//! 8 concurrent writers; and the one-insert transaction as the worst case.

use std::time::{Duration, Instant};

use anyhow::Result;
use outbox::{NewEvent, Outbox, OutboxConfig, Wakeup};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::common::*;

/// Concurrent writers.
const WRITERS: usize = 8;
const CUSTOMERS: i64 = 1_000;
const SKUS: i64 = 1_000;

/// Which transaction the writers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// BEGIN; lock the customer; take stock; insert the order; insert
    /// three lines; [enqueue]; COMMIT.
    Order,
    /// The order transaction with its event enqueued first, before the
    /// customer's and the stock's row locks are taken.
    OrderEventFirst,
    /// The order transaction and, where the event would go, one `INSERT`
    /// of the same bytes into a table with only a primary key: the least a
    /// durable event row can cost (no library, no outbox columns, no due
    /// index).
    OrderAndBareRow,
    /// BEGIN; insert one row; [enqueue]; COMMIT: the event's relative cost
    /// at its largest.
    OneInsert,
    /// One insert and one more statement that does nothing (`SELECT 1`):
    /// the ceiling of any event written by a statement of its own.
    OneInsertAndNoop,
    /// One insert and one more `INSERT` of the event's bytes into a table
    /// with only a primary key (see [`Shape::OrderAndBareRow`]).
    OneInsertAndBareRow,
    /// One insert and a hand-written `INSERT` of the event into the outbox
    /// table: the library's columns and values, without `ON CONFLICT`.
    OneInsertAndOutboxRow,
    /// One insert and a bare `pg_logical_emit_message` of the bytes the
    /// log capture writes for one event: the least a log event can cost
    /// (no slot check, no ordered-type lookup, no library).
    OneInsertAndBareEmit,
}

struct Statements {
    customer: String,
    stock: String,
    order: String,
    lines: String,
    one: String,
    bare_row: String,
    outbox_row: String,
    /// The log capture's message prefix.
    prefix: String,
}

impl Statements {
    fn new(s: &str) -> Self {
        Self {
            customer: format!("SELECT credit FROM \"{s}\".customers WHERE id = $1 FOR UPDATE"),
            stock: format!(
                "UPDATE \"{s}\".stock SET available = available - $2 WHERE sku = $1 AND available >= $2 RETURNING available"
            ),
            order: format!(
                "INSERT INTO \"{s}\".orders (id, customer_id, total_cents, event_id) VALUES ($1, $2, $3, $4)"
            ),
            lines: format!(
                "INSERT INTO \"{s}\".order_lines (order_id, line, sku, qty, price_cents) \
                 SELECT $1, l, s, q, p FROM unnest($2::int[], $3::text[], $4::int[], $5::bigint[]) AS t(l, s, q, p)"
            ),
            one: format!("INSERT INTO \"{s}\".one_row (sku, qty) VALUES ($1, $2)"),
            bare_row: format!("INSERT INTO \"{s}\".bare_events (id, payload) VALUES ($1, $2)"),
            outbox_row: format!(
                "INSERT INTO \"{s}\".outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key) \
                 VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8)"
            ),
            prefix: format!("outbox:{s}"),
        }
    }
}

async fn setup(pool: &PgPool) -> Result<String> {
    let schema = fresh_schema(pool, "write").await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".customers (id bigint PRIMARY KEY, credit bigint NOT NULL);
         INSERT INTO \"{schema}\".customers SELECT g, 1000000 FROM generate_series(0, {c}) g;
         CREATE TABLE \"{schema}\".stock (sku text PRIMARY KEY, available bigint NOT NULL);
         INSERT INTO \"{schema}\".stock SELECT 'sku-' || g, 1000000000 FROM generate_series(0, {k}) g;
         CREATE TABLE \"{schema}\".orders (
             id uuid PRIMARY KEY, customer_id bigint NOT NULL REFERENCES \"{schema}\".customers,
             total_cents bigint NOT NULL, event_id uuid NOT NULL UNIQUE,
             created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE \"{schema}\".order_lines (
             order_id uuid NOT NULL REFERENCES \"{schema}\".orders, line int NOT NULL,
             sku text NOT NULL, qty int NOT NULL CHECK (qty > 0), price_cents bigint NOT NULL,
             PRIMARY KEY (order_id, line));
         CREATE TABLE \"{schema}\".one_row (id bigserial PRIMARY KEY, sku text NOT NULL, qty int NOT NULL);
         CREATE TABLE \"{schema}\".bare_events (id uuid PRIMARY KEY, payload jsonb NOT NULL);
         ANALYZE \"{schema}\".customers; ANALYZE \"{schema}\".stock;",
        c = CUSTOMERS - 1,
        k = SKUS - 1
    )))
    .execute(pool)
    .await?;
    Ok(schema)
}

/// The event of an order: its id, customer and lines, padded to
/// [`PAYLOAD_BYTES`] of JSON.
fn order_placed(order: Uuid, customer: i64, skus: &[String]) -> serde_json::Value {
    let mut v = json!({
        "order_id": order,
        "customer_id": customer,
        "lines": skus.iter().map(|s| json!({"sku": s, "qty": 1, "price_cents": 1999})).collect::<Vec<_>>(),
        "note": "",
    });
    let len = v.to_string().len();
    v["note"] = json!("x".repeat(PAYLOAD_BYTES.saturating_sub(len)));
    v
}

/// Transactions per second of [`WRITERS`] writers running `shape` for
/// `secs`, with one event per transaction when `mode` is set.
pub(crate) async fn write_path(
    pool: &PgPool,
    shape: Shape,
    mode: Option<Wakeup>,
    secs: f64,
) -> Result<f64> {
    write_path_altered(pool, shape, mode, secs, None).await
}

/// [`write_path`] on a schema changed by `alter` first (SQL run once
/// after set-up, `{s}` standing for the quoted schema): to take one part
/// of the outbox table away and measure what it costs.
pub(crate) async fn write_path_altered(
    pool: &PgPool,
    shape: Shape,
    mode: Option<Wakeup>,
    secs: f64,
    alter: Option<&str>,
) -> Result<f64> {
    let schema = setup(pool).await?;
    if let Some(alter) = alter {
        sqlx::raw_sql(AssertSqlSafe(
            alter.replace("{s}", &format!("\"{schema}\"")),
        ))
        .execute(pool)
        .await?;
    }
    let ob = match mode {
        Some(m) => Some(
            Outbox::new(pool, {
                let mut c = OutboxConfig::default();
                c.schema = schema.to_string();
                c.wakeup = m;
                c.capture = capture();
                c
            })
            .await?,
        ),
        None => None,
    };
    let sql = std::sync::Arc::new(Statements::new(&schema));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (pool, ob, sql) = (pool.clone(), ob.clone(), sql.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut seed = w as i64 * 7919;
            while Instant::now() < deadline {
                seed = (seed * 1_103_515_245 + 12_345) & 0x7fff_ffff;
                let mut tx = pool.begin().await?;
                let event = match shape {
                    Shape::Order | Shape::OrderEventFirst | Shape::OrderAndBareRow => {
                        let customer = seed % CUSTOMERS;
                        let skus: Vec<String> = (0..3)
                            .map(|k| format!("sku-{}", (seed / 7 + k * 331) % SKUS))
                            .collect();
                        let mut sorted = skus.clone();
                        sorted.sort(); // a fixed lock order: no deadlocks
                        let (order, event_id) = (Uuid::now_v7(), Uuid::now_v7());
                        let event = match &ob {
                            Some(_) => Some(
                                NewEvent::new(
                                    "order",
                                    order.to_string(),
                                    "OrderPlaced",
                                    &order_placed(order, customer, &skus),
                                )?
                                .with_id(event_id),
                            ),
                            None => None,
                        };
                        let event = match (&ob, event) {
                            (Some(ob), Some(e)) if shape == Shape::OrderEventFirst => {
                                ob.enqueue(&mut *tx, e).await?;
                                None
                            }
                            (_, e) => e,
                        };
                        let _: i64 = sqlx::query_scalar(AssertSqlSafe(sql.customer.clone()))
                            .bind(customer)
                            .fetch_one(&mut *tx)
                            .await?;
                        for sku in &sorted {
                            let _: i64 = sqlx::query_scalar(AssertSqlSafe(sql.stock.clone()))
                                .bind(sku)
                                .bind(1i64)
                                .fetch_one(&mut *tx)
                                .await?;
                        }
                        sqlx::query(AssertSqlSafe(sql.order.clone()))
                            .bind(order)
                            .bind(customer)
                            .bind(3 * 1999i64)
                            .bind(event_id)
                            .execute(&mut *tx)
                            .await?;
                        sqlx::query(AssertSqlSafe(sql.lines.clone()))
                            .bind(order)
                            .bind(vec![1i32, 2, 3])
                            .bind(&skus)
                            .bind(vec![1i32; 3])
                            .bind(vec![1999i64; 3])
                            .execute(&mut *tx)
                            .await?;
                        if shape == Shape::OrderAndBareRow {
                            sqlx::query(AssertSqlSafe(sql.bare_row.clone()))
                                .bind(event_id)
                                .bind(sqlx::types::Json(order_placed(order, customer, &skus)))
                                .execute(&mut *tx)
                                .await?;
                        }
                        event
                    }
                    Shape::OneInsert
                    | Shape::OneInsertAndNoop
                    | Shape::OneInsertAndBareRow
                    | Shape::OneInsertAndOutboxRow
                    | Shape::OneInsertAndBareEmit => {
                        sqlx::query(AssertSqlSafe(sql.one.clone()))
                            .bind("A-1")
                            .bind(w as i32)
                            .execute(&mut *tx)
                            .await?;
                        if shape == Shape::OneInsertAndNoop {
                            sqlx::query("SELECT 1").execute(&mut *tx).await?;
                        }
                        if shape == Shape::OneInsertAndBareRow {
                            sqlx::query(AssertSqlSafe(sql.bare_row.clone()))
                                .bind(Uuid::now_v7())
                                .bind(sqlx::types::Json(payload()))
                                .execute(&mut *tx)
                                .await?;
                        }
                        if shape == Shape::OneInsertAndOutboxRow {
                            sqlx::query(AssertSqlSafe(sql.outbox_row.clone()))
                                .bind(Uuid::now_v7())
                                .bind("order")
                                .bind(n.to_string())
                                .bind("OrderPlaced")
                                .bind(payload().to_string())
                                .bind("{}")
                                .bind(None::<String>)
                                .bind(None::<String>)
                                .execute(&mut *tx)
                                .await?;
                        }
                        if shape == Shape::OneInsertAndBareEmit {
                            sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
                                .bind(&sql.prefix)
                                .bind(bare_message(n))
                                .execute(&mut *tx)
                                .await?;
                        }
                        match &ob {
                            Some(_) => Some(NewEvent::new(
                                "order",
                                n.to_string(),
                                "OrderPlaced",
                                &payload(),
                            )?),
                            None => None,
                        }
                    }
                };
                match (&ob, event) {
                    (Some(ob), Some(event)) => {
                        ob.enqueue(&mut *tx, event).await?;
                        ob.commit(tx).await?;
                    }
                    _ => tx.commit().await?,
                }
                n += 1;
            }
            Ok::<_, anyhow::Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    drop_schema(pool, &schema).await?;
    Ok(total as f64 / secs)
}

/// The message the log capture writes for event `n` (its contract's
/// fields, the bench's payload), as one text.
fn bare_message(n: u64) -> String {
    format!(
        r#"{{"v":1,"id":"{}","aggregate_type":"order","aggregate_id":"{n}","event_type":"OrderPlaced","payload":{},"headers":{{}},"exchange":null,"routing_key":null,"created_at":"2026-12-02T00:00:00.000000+00:00"}}"#,
        Uuid::now_v7(),
        crate::common::payload(),
    )
}
