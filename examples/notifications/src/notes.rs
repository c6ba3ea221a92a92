//! The notifications table and the handler that writes it.

use std::collections::HashMap;

use outbox::Ident;
use outbox_consumer::{Event, Handler, Outcome};
use serde::Deserialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// The part of `OrderPlaced` this service reads.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    order_id: String,
    sku: String,
    qty: i64,
}

/// Notifications in one schema of this service's database, and the
/// [`Handler`] that records them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Notifications {
    insert: SqlStr,
    per_order: SqlStr,
}

impl Notifications {
    /// Migrates the consumer's tables (inbox) into `schema` and creates the
    /// `notifications` table if missing. Idempotent.
    pub async fn setup(pool: &PgPool, schema: &str) -> outbox_consumer::Result<Self> {
        let q = Ident::new("schema", schema)?.quoted();
        outbox_consumer::migrate(pool, schema).await?;
        // No unique key on order_id on purpose: only the inbox keeps a
        // duplicate delivery from notifying twice.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {q}.notifications (
                 id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 order_id text NOT NULL,
                 event_id text NOT NULL,
                 message text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now()
             )"
        )))
        .execute(pool)
        .await?;
        let sql = |s: String| AssertSqlSafe(s).into_sql_str();
        Ok(Self {
            insert: sql(format!(
                "INSERT INTO {q}.notifications (order_id, event_id, message) VALUES ($1, $2, $3)"
            )),
            per_order: sql(format!(
                "SELECT order_id, count(*) FROM {q}.notifications GROUP BY order_id"
            )),
        })
    }

    /// How many notifications each order got.
    pub async fn per_order(&self, pool: &PgPool) -> sqlx::Result<HashMap<String, i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(self.per_order.clone())
            .fetch_all(pool)
            .await?;
        Ok(rows.into_iter().collect())
    }
}

impl Handler for Notifications {
    /// Records one "order placed" notification; a database error is
    /// retried.
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        if event.event_type() != Some("OrderPlaced") {
            return Outcome::Ack;
        }
        let order = match event.payload::<OrderPlaced>() {
            Ok(order) => order,
            Err(e) => return Outcome::reject(format!("not an OrderPlaced payload: {e}")),
        };
        let message = format!(
            "Your order {} of {} x {} is placed",
            order.order_id, order.qty, order.sku
        );
        let written = sqlx::query(self.insert.clone())
            .bind(&order.order_id)
            .bind(event.id())
            .bind(&message)
            .execute(conn)
            .await;
        match written {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}
