//! Unordered events: the oldest due, whoever wrote them, skipping rows
//! other relays hold.

use outbox::Ident;
use sqlx::{PgConnection, SqlStr};

use crate::claim::CLAIM_COLUMNS;
use crate::error::Result;
use crate::message::{ClaimedEvent, ClaimedRow};
use crate::relay::Inner;

/// Claim due unordered events, oldest first, skipping rows other relays
/// hold. `$1` batch size.
pub(crate) fn statement(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    crate::queries::sql(format!(
        "SELECT {CLAIM_COLUMNS} FROM {s}.outbox
         WHERE available_at <= now() AND aggregate_seq IS NULL
         ORDER BY available_at, id
         LIMIT $1
         FOR UPDATE SKIP LOCKED"
    ))
}

/// Claims up to `room` due unordered events.
pub(crate) async fn claim(
    inner: &Inner,
    conn: &mut PgConnection,
    room: usize,
) -> Result<Vec<ClaimedEvent>> {
    let rows: Vec<ClaimedRow> = sqlx::query_as(inner.queries.claim.clone())
        .bind(room as i64)
        .fetch_all(conn)
        .await?;
    Ok(rows.into_iter().map(ClaimedEvent::from).collect())
}
