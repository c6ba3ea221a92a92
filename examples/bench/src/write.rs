//! The producer's write path: a small business transaction with and
//! without one enqueued event, 8 concurrent writers.

use std::time::{Duration, Instant};

use anyhow::Result;
use outbox::{NewEvent, Outbox, OutboxConfig, Wakeup};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool};

use crate::common::*;

/// Transactions per second of 8 writers, each inserting one business row
/// and (with `mode`) one event, for `secs`.
pub(crate) async fn write_path(pool: &PgPool, mode: Option<Wakeup>, secs: f64) -> Result<f64> {
    let schema = fresh_schema(pool, "write").await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".orders (id bigserial PRIMARY KEY, sku text NOT NULL, qty int NOT NULL)"
    )))
    .execute(pool)
    .await?;
    let ob = match mode {
        Some(m) => {
            Some(Outbox::new(pool, OutboxConfig::default().schema(&schema).wakeup(m)).await?)
        }
        None => None,
    };
    let insert = format!("INSERT INTO \"{schema}\".orders (sku, qty) VALUES ($1, $2)");
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..8 {
        let pool = pool.clone();
        let ob = ob.clone();
        let insert = insert.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let mut tx = pool.begin().await?;
                sqlx::query(AssertSqlSafe(insert.clone()))
                    .bind("A-1")
                    .bind(w)
                    .execute(&mut *tx)
                    .await?;
                match &ob {
                    Some(ob) => {
                        let event = NewEvent::new(
                            "order",
                            n.to_string(),
                            "OrderPlaced",
                            &json!({"sku": "A-1", "qty": w}),
                        )?;
                        ob.enqueue(&mut *tx, event).await?;
                        ob.commit(tx).await?;
                    }
                    None => tx.commit().await?,
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
