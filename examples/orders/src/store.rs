//! The orders table and the one write that matters: an order and its
//! `OrderPlaced` event, in the caller's transaction.

use outbox::{Ident, NewEvent, Outbox, OutboxConfig};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};
use uuid::Uuid;

/// Aggregate type of order events.
pub const AGGREGATE_TYPE: &str = "order";
/// Event type written for every placed order; the relay routes it as
/// `order.OrderPlaced` unless told otherwise.
pub const ORDER_PLACED: &str = "OrderPlaced";
/// Largest quantity one order may ask for.
pub const MAX_QTY: i32 = 1000;

/// An order as a client sends it (`POST /orders`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewOrder {
    /// Stock keeping unit, 1 to 64 characters.
    pub sku: String,
    /// Quantity, 1 to [`MAX_QTY`].
    pub qty: i32,
}

impl NewOrder {
    /// Checks the business rules; `Err` says what is wrong, for the client.
    pub fn validate(&self) -> Result<(), String> {
        if self.sku.is_empty() || self.sku.len() > 64 {
            return Err("sku must be 1 to 64 characters".to_owned());
        }
        if !(1..=MAX_QTY).contains(&self.qty) {
            return Err(format!("qty must be between 1 and {MAX_QTY}"));
        }
        Ok(())
    }
}

/// A placed order, as stored and as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Order {
    /// The order id (UUIDv7).
    pub id: Uuid,
    /// Stock keeping unit.
    pub sku: String,
    /// Quantity.
    pub qty: i32,
    /// Id of the `OrderPlaced` event written with it (the AMQP `message_id`).
    pub event_id: Uuid,
}

/// Payload of the `OrderPlaced` event.
#[derive(Debug, Serialize)]
struct OrderPlaced<'a> {
    order_id: Uuid,
    sku: &'a str,
    qty: i32,
}

/// The orders of one schema, with the outbox beside them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Orders {
    outbox: Outbox,
    insert: SqlStr,
    select: SqlStr,
}

impl Orders {
    /// Migrates the outbox tables into `schema`, creates the `orders` table
    /// if missing and opens the outbox (which wakes relays after commits).
    pub async fn setup(pool: &PgPool, schema: &str) -> outbox::Result<Self> {
        Self::setup_with(pool, schema, outbox::Capture::Table).await
    }

    /// [`Orders::setup`] with the events written as `capture` says: rows
    /// of the outbox table, or messages in the write-ahead log
    /// ([`outbox::Capture::Wal`]: the schema's slot must exist,
    /// `outbox-relay migrate --capture wal`).
    pub async fn setup_with(
        pool: &PgPool,
        schema: &str,
        capture: outbox::Capture,
    ) -> outbox::Result<Self> {
        let ident = Ident::new("schema", schema)?;
        outbox::migrate(pool, schema).await?;
        let q = ident.quoted();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {q}.orders (
                 id uuid PRIMARY KEY,
                 sku text NOT NULL,
                 qty integer NOT NULL CHECK (qty > 0),
                 event_id uuid NOT NULL UNIQUE,
                 created_at timestamptz NOT NULL DEFAULT now()
             )"
        )))
        .execute(pool)
        .await?;
        let outbox = Outbox::new(pool, {
            let mut c = OutboxConfig::default();
            c.schema = schema.to_string();
            c.capture = capture;
            c
        })
        .await?;
        Ok(Self {
            outbox,
            insert: AssertSqlSafe(format!(
                "INSERT INTO {q}.orders (id, sku, qty, event_id) VALUES ($1, $2, $3, $4)"
            ))
            .into_sql_str(),
            select: AssertSqlSafe(format!(
                "SELECT id, sku, qty, event_id FROM {q}.orders WHERE id = $1"
            ))
            .into_sql_str(),
        })
    }

    /// The outbox the events go to.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// Writes `order` and its `OrderPlaced` event through `conn`. Both rows
    /// commit or roll back with the caller's transaction: an order is never
    /// without its event, and an event never without its order.
    pub async fn place(&self, conn: &mut PgConnection, order: &NewOrder) -> outbox::Result<Order> {
        let placed = Order {
            id: Uuid::now_v7(),
            sku: order.sku.clone(),
            qty: order.qty,
            event_id: Uuid::now_v7(),
        };
        sqlx::query(self.insert.clone())
            .bind(placed.id)
            .bind(&placed.sku)
            .bind(placed.qty)
            .bind(placed.event_id)
            .execute(&mut *conn)
            .await?;
        let payload = OrderPlaced {
            order_id: placed.id,
            sku: &placed.sku,
            qty: placed.qty,
        };
        let event = NewEvent::new(
            AGGREGATE_TYPE,
            placed.id.to_string(),
            ORDER_PLACED,
            &payload,
        )?
        .with_id(placed.event_id);
        self.outbox.enqueue(conn, event).await?;
        Ok(placed)
    }

    /// The order with this id, if any.
    pub async fn find(&self, pool: &PgPool, id: Uuid) -> outbox::Result<Option<Order>> {
        Ok(sqlx::query_as(self.select.clone())
            .bind(id)
            .fetch_optional(pool)
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let ok = NewOrder {
            sku: "A-1".into(),
            qty: 3,
        };
        assert!(ok.validate().is_ok());
        let zero = NewOrder {
            qty: 0,
            ..ok.clone()
        };
        assert!(zero.validate().unwrap_err().contains("qty"));
        let blank = NewOrder {
            sku: String::new(),
            ..ok
        };
        assert!(blank.validate().unwrap_err().contains("sku"));
    }
}
