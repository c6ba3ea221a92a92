//! [`Capture::Wal`]: events as transactional logical decoding messages in
//! the write-ahead log, and the checks that something will read them.

use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};
use uuid::Uuid;

use super::handle::Outbox;
use crate::error::Result;
use crate::event::NewEvent;
use outbox_core::Ident;

#[cfg(doc)]
use super::config::Capture;

impl Outbox {
    /// Writes one validated event as a message and returns its id.
    pub(super) async fn emit_one(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid> {
        let written = sqlx::query(self.inner.insert_one.clone())
            .bind(&self.inner.prefix)
            .bind(wal_head(&event))
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.wal_error(e))?;
        if written.rows_affected() != 1 {
            return Err(self.not_readable(conn).await);
        }
        Ok(event.id)
    }

    /// Writes validated events (at least one) as messages with one
    /// statement and returns their ids in input order.
    pub(super) async fn emit_many(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<Uuid>> {
        let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
        let heads: Vec<String> = events.iter().map(wal_head).collect();
        let (types, aggregates): (Vec<&str>, Vec<&str>) = events
            .iter()
            .map(|e| (e.aggregate_type.as_str(), e.aggregate_id.as_str()))
            .unzip();
        let written = sqlx::query(self.inner.insert_many.clone())
            .bind(&self.inner.prefix)
            .bind(&heads)
            .bind(&types)
            .bind(&aggregates)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.wal_error(e))?;
        if written.rows_affected() != ids.len() as u64 {
            return Err(self.not_readable(conn).await);
        }
        Ok(ids)
    }

    /// A write to the log refused because nothing would read it
    /// (`outbox_wal_ready`: the slot was dropped or invalidated since
    /// [`Outbox::new`]) is [`crate::Error::WalCaptureNotReady`].
    fn wal_error(&self, e: sqlx::Error) -> crate::Error {
        not_ready(&self.inner.schema, e)
    }

    /// The statement wrote nothing: no slot would read it
    /// (`outbox_wal_readable` has no row). Asks `outbox_wal_ready` why,
    /// which raises and so aborts the caller's transaction: its business
    /// writes cannot commit without their event.
    async fn not_readable(&self, conn: &mut PgConnection) -> crate::Error {
        let why = sqlx::query(AssertSqlSafe(format!(
            "SELECT {}.outbox_wal_ready()",
            self.inner.schema.quoted()
        )))
        .execute(&mut *conn)
        .await;
        match why {
            Err(e) => self.wal_error(e),
            // Readable again this instant: nothing was written all the same.
            Ok(_) => crate::Error::WalCaptureNotReady {
                schema: self.inner.schema.to_string(),
                reason: "the replication slot was not readable when the event was written (it is now); nothing was written, retry the transaction".to_owned(),
            },
        }
    }
}

/// [`Capture::Wal`] writes into nothing unless the database decodes the
/// log and the schema's slot exists: refuse it at start-up instead (every
/// write checks the slot again: `outbox_wal_ready`).
pub(super) async fn ensure_wal_ready(pool: &PgPool, schema: &Ident) -> Result<()> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await?;
    if wal_level != "logical" {
        return Err(crate::Error::WalCaptureNotReady {
            schema: schema.to_string(),
            reason: format!("the database's wal_level is {wal_level:?}, not \"logical\""),
        });
    }
    sqlx::query(AssertSqlSafe(format!(
        "SELECT {}.outbox_wal_ready()",
        schema.quoted()
    )))
    .execute(pool)
    .await
    .map_err(|e| not_ready(schema, e))?;
    Ok(())
}

/// `outbox_wal_ready`'s refusal (SQLSTATE 55000) as
/// [`crate::Error::WalCaptureNotReady`]; other errors as they are.
fn not_ready(schema: &Ident, e: sqlx::Error) -> crate::Error {
    let refusal = e
        .as_database_error()
        .filter(|d| d.code().as_deref() == Some("55000"))
        .map(|d| d.message().to_owned());
    match refusal {
        Some(message) => {
            let prefix = format!("write-ahead-log capture of schema {schema}: ");
            crate::Error::WalCaptureNotReady {
                schema: schema.to_string(),
                reason: message.strip_prefix(&prefix).unwrap_or(&message).to_owned(),
            }
        }
        None => crate::Error::Database(e),
    }
}

/// The message content of `event` (the contract in docs/WAL_CAPTURE.md),
/// up to and including `"created_at":`: the statement adds the
/// transaction's time, the aggregate's next number when its type is
/// ordered, and the closing brace. The payload goes as the producer's JSON
/// text (validated, not re-normalised).
fn wal_head(event: &NewEvent) -> String {
    let text = |s: &str| serde_json::Value::from(s).to_string();
    let optional = |s: &Option<String>| s.as_deref().map_or("null".to_owned(), text);
    format!(
        r#"{{"v":1,"id":"{}","aggregate_type":{},"aggregate_id":{},"event_type":{},"payload":{},"headers":{},"exchange":{},"routing_key":{},"created_at":"#,
        event.id,
        text(&event.aggregate_type),
        text(&event.aggregate_id),
        text(&event.event_type),
        event.payload,
        serde_json::Value::Object(event.headers.clone()),
        optional(&event.exchange),
        optional(&event.routing_key),
    )
}

/// The tail `outbox_emit` also writes: the time, the sequence of an
/// ordered aggregate (`$3` type, `$4` id, or a row's columns), the brace.
fn wal_tail(s: &str, aggregate_type: &str, aggregate_id: &str) -> String {
    format!(
        "to_json(now())::text
         || CASE WHEN EXISTS (SELECT 1 FROM {s}.outbox_ordered_types t
                              WHERE t.aggregate_type IN ({aggregate_type}, '*'))
                 THEN ',\"aggregate_seq\":' || {s}.outbox_next_seq({aggregate_type}, {aggregate_id})
                 ELSE '' END
         || '}}'"
    )
}

// The schema is a validated `Ident`; everything else is bound. One plain
// statement per event, no function call unless the type is ordered:
// measured cheaper for producers than calling `outbox_emit`. The slot is
// checked in the same statement (`outbox_wal_readable`, a one-time
// filter: no row written when nothing would read it; the caller then asks
// `outbox_wal_ready` why, which aborts the transaction).
pub(super) fn emit_one_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "SELECT pg_logical_emit_message(true, $1, $2 || {}) WHERE EXISTS (SELECT 1 FROM {s}.outbox_wal_readable)",
        wal_tail(&s, "$3", "$4")
    ))
    .into_sql_str()
}

/// In aggregate key order (input order within an aggregate), like the
/// insert: ordered aggregates' counters are taken in one order by every
/// writer. A sorted subquery is never flattened, so the messages are
/// emitted in that order.
pub(super) fn emit_many_sql(schema: &Ident) -> SqlStr {
    let s = schema.quoted();
    AssertSqlSafe(format!(
        "SELECT pg_logical_emit_message(true, $1, e.head || {})
         FROM (SELECT * FROM unnest($2::text[], $3::text[], $4::text[])
                    WITH ORDINALITY AS e(head, aggregate_type, aggregate_id, n)
               ORDER BY aggregate_type, aggregate_id, n) e
         WHERE EXISTS (SELECT 1 FROM {s}.outbox_wal_readable)",
        wal_tail(&s, "e.aggregate_type", "e.aggregate_id")
    ))
    .into_sql_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_message_head_is_json_whatever_the_fields_hold() {
        let event = NewEvent::from_json(
            "order \"x\"",
            "o\n1\\",
            "Placed\u{1F600}",
            r#"{"a": [1, {"b": null}]}"#,
        )
        .unwrap()
        .header("traceparent", "00-abc")
        .exchange("ex")
        .with_id(Uuid::nil());
        let text = format!("{}\"2026-12-01T10:00:00+00:00\"}}", wal_head(&event));
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert_eq!(v["v"], 1);
        assert_eq!(v["id"], Uuid::nil().to_string());
        assert_eq!(v["aggregate_type"], "order \"x\"");
        assert_eq!(v["aggregate_id"], "o\n1\\");
        assert_eq!(v["event_type"], "Placed\u{1F600}");
        assert_eq!(v["payload"], serde_json::json!({"a": [1, {"b": null}]}));
        assert_eq!(v["headers"], serde_json::json!({"traceparent": "00-abc"}));
        assert_eq!(v["exchange"], "ex");
        assert_eq!(v["routing_key"], serde_json::Value::Null);
        assert_eq!(v["created_at"], "2026-12-01T10:00:00+00:00");
    }
}
