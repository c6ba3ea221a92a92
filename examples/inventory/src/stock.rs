//! The stock table and the handler that moves it.

use outbox::Ident;
use outbox_consumer::{Event, Handler, Outcome};
use serde::Deserialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// The part of `OrderPlaced` this service reads.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    sku: String,
    qty: i64,
}

/// Stock levels in one schema of the inventory database, and the
/// [`Handler`] that decrements them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Stock {
    decrement: SqlStr,
    seed: SqlStr,
    levels: SqlStr,
}

impl Stock {
    /// Migrates the consumer's tables (inbox) into `schema` and creates the
    /// `stock` table if missing. Idempotent.
    pub async fn setup(pool: &PgPool, schema: &str) -> outbox_consumer::Result<Self> {
        let q = Ident::new("schema", schema)?.quoted();
        outbox_consumer::migrate(pool, schema).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {q}.stock (
                 sku text PRIMARY KEY,
                 qty bigint NOT NULL CHECK (qty >= 0)
             )"
        )))
        .execute(pool)
        .await?;
        let sql = |s: String| AssertSqlSafe(s).into_sql_str();
        Ok(Self {
            // Deliberately NOT idempotent: running it twice for one order
            // takes the stock twice. Only the inbox makes it exactly once.
            decrement: sql(format!(
                "UPDATE {q}.stock SET qty = qty - $2 WHERE sku = $1"
            )),
            seed: sql(format!(
                "INSERT INTO {q}.stock (sku, qty) VALUES ($1, $2)
                 ON CONFLICT (sku) DO UPDATE SET qty = EXCLUDED.qty"
            )),
            levels: sql(format!("SELECT sku, qty FROM {q}.stock ORDER BY sku")),
        })
    }

    /// Sets the stock of `sku` to `qty`.
    pub async fn seed(&self, pool: &PgPool, sku: &str, qty: i64) -> sqlx::Result<()> {
        sqlx::query(self.seed.clone())
            .bind(sku)
            .bind(qty)
            .execute(pool)
            .await?;
        Ok(())
    }

    /// Every sku with its stock, by sku.
    pub async fn levels(&self, pool: &PgPool) -> sqlx::Result<Vec<(String, i64)>> {
        sqlx::query_as(self.levels.clone()).fetch_all(pool).await
    }
}

impl Handler for Stock {
    /// Takes the ordered quantity off the stock. An unknown sku or an
    /// order larger than the stock is rejected (dead-lettered for a human);
    /// a database error is retried.
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        if event.event_type() != Some("OrderPlaced") {
            return Outcome::Ack; // other order events do not move stock
        }
        let order = match event.payload::<OrderPlaced>() {
            Ok(order) => order,
            Err(e) => return Outcome::reject(format!("not an OrderPlaced payload: {e}")),
        };
        let moved = sqlx::query(self.decrement.clone())
            .bind(&order.sku)
            .bind(order.qty)
            .execute(conn)
            .await;
        match moved {
            Ok(done) if done.rows_affected() == 1 => Outcome::Ack,
            Ok(_) => Outcome::reject(format!("unknown sku {:?}", order.sku)),
            Err(sqlx::Error::Database(e)) if e.is_check_violation() => {
                Outcome::reject(format!("not enough stock of {:?}", order.sku))
            }
            Err(e) => Outcome::retry(e),
        }
    }
}
