//! Unordered events: the oldest due, whoever wrote them, skipping rows
//! other relays hold.

use sqlx::PgConnection;

use crate::error::Result;
use crate::message::{ClaimedEvent, ClaimedRow};
use crate::relay::Inner;

/// Claims up to `room` due unordered events (`unordered.sql`).
pub(crate) async fn claim(
    inner: &Inner,
    conn: &mut PgConnection,
    room: usize,
) -> Result<Vec<ClaimedEvent>> {
    let rows: Vec<ClaimedRow> = sqlx::query_as(inner.claim_sql.unordered.clone())
        .bind(room as i64)
        .fetch_all(conn)
        .await?;
    Ok(rows.into_iter().map(ClaimedEvent::from).collect())
}
