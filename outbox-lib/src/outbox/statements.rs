//! The statements a handle renders once, at start-up, for its schema
//! (`*.sql` beside this file; every value is bound), and the
//! start-up check of the write-ahead-log capture. The writers (`table.rs`,
//! `wal.rs`) run them.

use outbox_core::sql::{Template, render};
use sqlx::{PgPool, SqlStr};

use crate::error::Result;
use outbox_core::Ident;

pub(super) fn insert_one_sql(schema: &Ident) -> SqlStr {
    render(include_str!("insert_one.sql"), schema)
}

pub(super) fn insert_many_sql(schema: &Ident) -> SqlStr {
    render(include_str!("insert_many.sql"), schema)
}

/// A statement writing into the log: `template` with its `{wal_tail}`.
fn emit_sql(template: &str, schema: &Ident) -> SqlStr {
    let tail = Template::new(include_str!("wal_tail.sql"), schema).text();
    Template::new(template, schema)
        .with("wal_tail", tail)
        .render()
}

/// The slot is checked in the same statement (`outbox_wal_readable`):
/// when no row is written, the caller asks `outbox_wal_ready` why, which
/// aborts the transaction.
pub(super) fn emit_one_sql(schema: &Ident) -> SqlStr {
    emit_sql(include_str!("emit_one.sql"), schema)
}

pub(super) fn emit_many_sql(schema: &Ident) -> SqlStr {
    emit_sql(include_str!("emit_many.sql"), schema)
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
    sqlx::query(render("SELECT {schema}.outbox_wal_ready()", schema))
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
