//! The write-ahead-log capture's test helpers: the log's position and
//! the slot's, the reader's reports, the SQL producer path, events
//! committed through an `Outbox`.

use std::time::Duration;

use serde_json::json;
use sqlx::AssertSqlSafe;

use crate::{TestDb, wait_until};
use outbox::NewEvent;

/// The log's current end.
pub async fn position(db: &TestDb) -> String {
    sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Whether the slot's confirmed position has reached `lsn`.
pub async fn confirmed_past(db: &TestDb, lsn: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(db.slot())
    .bind(lsn)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Waits for `n` more position reports from the replication session
/// named `application_name`.
pub async fn reports(db: &TestDb, application_name: &str, n: usize) {
    for _ in 0..n {
        let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        wait_until(Duration::from_secs(60), "a report from the reader", || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(max(reply_time) > $2, false) FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(application_name)
            .bind(since)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        })
        .await;
    }
}

/// The SQL producer path: `outbox_emit` of an event of aggregate `$1`
/// (returns its id).
pub fn emit_sql(
    schema: &str,
) -> sqlx::query::QueryScalar<'static, sqlx::Postgres, uuid::Uuid, sqlx::postgres::PgArguments> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT \"{schema}\".outbox_emit('order', $1, 'OrderPlaced', '{{}}')"
    )))
}

/// One event through the SQL producer path, in its own transaction.
pub async fn emit(db: &TestDb, aggregate_id: &str) -> Result<uuid::Uuid, sqlx::Error> {
    emit_sql(&db.schema)
        .bind(aggregate_id.to_owned())
        .fetch_one(&db.pool)
        .await
}

/// Commits `n` events through `ob`, `per_tx` per transaction; returns
/// their ids.
pub async fn commit_events(
    db: &TestDb,
    ob: &outbox::Outbox,
    n: usize,
    per_tx: usize,
) -> Vec<uuid::Uuid> {
    let mut ids = Vec::with_capacity(n);
    for start in (0..n).step_by(per_tx) {
        let mut tx = db.pool.begin().await.unwrap();
        for i in start..(start + per_tx).min(n) {
            let e =
                NewEvent::new("order", format!("o-{i}"), "OrderPlaced", &json!({"i": i})).unwrap();
            ids.push(ob.enqueue(&mut *tx, e).await.unwrap());
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// `url` with its database name replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let (server, _) = base
        .rsplit_once('/')
        .expect("a database URL names a database");
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}
