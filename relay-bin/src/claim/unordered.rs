//! Unordered events: the oldest due, whoever wrote them, skipping rows
//! other relays hold.

use sqlx::{PgConnection, SqlStr};

use crate::error::Result;
use crate::message::{ClaimedRow, OutboxEvent};

/// Claims up to `room` due unordered events (`unordered.sql`).
pub(crate) async fn claim(
    statement: &SqlStr,
    conn: &mut PgConnection,
    room: usize,
) -> Result<Vec<OutboxEvent>> {
    let rows: Vec<ClaimedRow> = sqlx::query_as(statement.clone())
        .bind(room as i64)
        .fetch_all(conn)
        .await?;
    Ok(rows.into_iter().map(OutboxEvent::from).collect())
}
