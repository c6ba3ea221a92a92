//! The statements a handle prepares once, at start-up, for its schema
//! (the schema is a validated [`Ident`]; every value is bound), and the
//! start-up check of the write-ahead-log capture. The writers (`table.rs`,
//! `wal.rs`) run them.

use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr, SqlStr};

use crate::error::Result;
use outbox_core::Ident;

pub(super) fn insert_one_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8)
         ON CONFLICT (id) DO NOTHING",
        schema.quoted()
    ))
    .into_sql_str()
}

pub(super) fn insert_many_sql(schema: &Ident) -> SqlStr {
    AssertSqlSafe(format!(
        "INSERT INTO {}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
         SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange, routing_key
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
              WITH ORDINALITY AS e(id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, n)
         ORDER BY aggregate_type, aggregate_id, n
         ON CONFLICT (id) DO NOTHING",
        schema.quoted()
    ))
    .into_sql_str()
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
pub(super) fn not_ready(schema: &Ident, e: sqlx::Error) -> crate::Error {
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
