//! [`Capture::Wal`]: events as transactional logical decoding messages in
//! the write-ahead log, and the checks that something will read them.

use outbox_core::Ident;
use outbox_core::sql::render;
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use super::statements::{emit_many_sql, emit_one_sql, not_ready};
use crate::error::Result;
use crate::event::NewEvent;

#[cfg(doc)]
use super::config::Capture;

/// Writes events as logical decoding messages.
#[derive(Debug)]
pub(super) struct WalWriter {
    schema: Ident,
    emit_one: SqlStr,
    /// Array binds: any number of events, one statement.
    emit_many: SqlStr,
    /// The messages' prefix (`outbox_core::wal_message_prefix`).
    prefix: String,
}

impl WalWriter {
    /// The writer of `schema`, whose log capture was checked ready.
    pub(super) fn new(schema: &Ident) -> Self {
        Self {
            emit_one: emit_one_sql(schema),
            emit_many: emit_many_sql(schema),
            prefix: outbox_core::wal_message_prefix(schema),
            schema: schema.clone(),
        }
    }

    /// Writes one validated event as a message and returns its id.
    pub(super) async fn emit_one(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid> {
        let written = sqlx::query(self.emit_one.clone())
            .bind(&self.prefix)
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
        let written = sqlx::query(self.emit_many.clone())
            .bind(&self.prefix)
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
    /// [`Outbox::new`](crate::Outbox::new)) is [`crate::Error::WalCaptureNotReady`].
    fn wal_error(&self, e: sqlx::Error) -> crate::Error {
        not_ready(&self.schema, e)
    }

    /// The statement wrote nothing: no slot would read it
    /// (`outbox_wal_readable` has no row). Asks `outbox_wal_ready` why,
    /// which raises and so aborts the caller's transaction: its business
    /// writes cannot commit without their event.
    async fn not_readable(&self, conn: &mut PgConnection) -> crate::Error {
        let why = sqlx::query(render("SELECT {schema}.outbox_wal_ready()", &self.schema))
            .execute(&mut *conn)
            .await;
        match why {
            Err(e) => self.wal_error(e),
            // Readable again this instant: nothing was written all the same.
            Ok(_) => crate::Error::WalCaptureNotReady {
                schema: self.schema.to_string(),
                reason: "the replication slot was not readable when the event was written (it is now); nothing was written, retry the transaction".to_owned(),
            },
        }
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
