//! The stock table and the batch handler that moves it.

use std::collections::BTreeMap;

use outbox::Ident;
use outbox_consumer::{BatchHandler, BatchOutcome, Event, Outcome};
use serde::Deserialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// The part of `OrderPlaced` this service reads.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    sku: String,
    qty: i64,
}

/// Stock levels in one schema of the inventory database, and the
/// [`BatchHandler`] that decrements them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Stock {
    lock: SqlStr,
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
            // Every row a batch moves, locked in one statement in sku
            // order: two instances whose batches share skus take their
            // locks in the same order, so one waits for the other instead
            // of both waiting for each other (a deadlock, which PostgreSQL
            // breaks only after `deadlock_timeout`, 1 s by default).
            lock: sql(format!(
                "SELECT sku, qty FROM {q}.stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE"
            )),
            // Deliberately NOT idempotent: running it twice for one order
            // takes the stock twice. Only the inbox makes it exactly once.
            decrement: sql(format!(
                "UPDATE {q}.stock AS s SET qty = s.qty - t.qty
                 FROM unnest($1::text[], $2::bigint[]) AS t(sku, qty)
                 WHERE s.sku = t.sku"
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

impl BatchHandler for Stock {
    /// Takes each order's quantity off the stock, in delivery order. An
    /// unknown sku or an order larger than the stock is rejected
    /// (dead-lettered for a human) and moves nothing; a database error
    /// fails the batch (a deadlock or serialization failure reruns it at
    /// once, anything else is retried).
    ///
    /// Two statements per batch whatever its size: the rows it touches,
    /// locked in sku order and read; then one decrement per sku.
    async fn handle_batch(&self, conn: &mut PgConnection, events: &[Event]) -> BatchOutcome {
        let orders: Vec<Result<OrderPlaced, Outcome>> = events.iter().map(order).collect();
        let mut skus: Vec<&str> = orders.iter().flatten().map(|o| o.sku.as_str()).collect();
        skus.sort_unstable();
        skus.dedup();
        let before: BTreeMap<String, i64> = if skus.is_empty() {
            BTreeMap::new()
        } else {
            match sqlx::query_as(self.lock.clone())
                .bind(&skus)
                .fetch_all(&mut *conn)
                .await
            {
                Ok(levels) => levels.into_iter().collect(),
                Err(e) => return BatchOutcome::All(e.into()),
            }
        };
        let mut after = before.clone();
        let outcomes = orders
            .iter()
            .map(|o| match o {
                Ok(o) => take(&mut after, o),
                Err(outcome) => outcome.clone(),
            })
            .collect();
        let (skus, taken): (Vec<&str>, Vec<i64>) = before
            .iter()
            .map(|(sku, qty)| (sku.as_str(), qty - after[sku]))
            .filter(|&(_, taken)| taken != 0)
            .unzip();
        if !skus.is_empty() {
            let moved = sqlx::query(self.decrement.clone())
                .bind(&skus)
                .bind(&taken)
                .execute(&mut *conn)
                .await;
            if let Err(e) = moved {
                return BatchOutcome::All(e.into());
            }
        }
        BatchOutcome::Each(outcomes)
    }
}

/// The order an event carries, or its outcome without one: other order
/// events move no stock (acked); a malformed payload is rejected.
fn order(event: &Event) -> Result<OrderPlaced, Outcome> {
    if event.event_type() != Some("OrderPlaced") {
        return Err(Outcome::Ack);
    }
    event
        .payload::<OrderPlaced>()
        .map_err(|e| Outcome::reject(format!("not an OrderPlaced payload: {e}")))
}

/// Takes `order` off `stock` (the levels as the batch has left them so
/// far), or rejects it without a change.
fn take(stock: &mut BTreeMap<String, i64>, order: &OrderPlaced) -> Outcome {
    let Some(left) = stock.get_mut(&order.sku) else {
        return Outcome::reject(format!("unknown sku {:?}", order.sku));
    };
    match left.checked_sub(order.qty) {
        Some(rest) if rest >= 0 => {
            *left = rest;
            Outcome::Ack
        }
        _ => Outcome::reject(format!("not enough stock of {:?}", order.sku)),
    }
}
