//! `outbox-relay blocked`: ordered aggregates held up by a failing event.

use crate::admin;
use anyhow::Result;
use outbox::Ident;
use sqlx::PgPool;

use super::args::BlockedCommand;

pub(super) async fn blocked(pool: &PgPool, schema: &Ident, cmd: &BlockedCommand) -> Result<()> {
    match cmd {
        BlockedCommand::List { limit, json } => {
            let rows = admin::blocked_aggregates(pool, schema, *limit).await?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                say!("no blocked aggregates");
            } else {
                print_blocked(&rows)?;
            }
        }
        BlockedCommand::Skip { ids, reason } => {
            let n = admin::skip_events(pool, schema, ids, reason).await?;
            say!("skipped {n} event(s): moved to the dead letters");
            if n < ids.len() as u64 {
                eprintln!(
                    "warning: {} of the ids were not in the outbox (delivered, or dead-lettered already)",
                    ids.len() as u64 - n
                );
            }
        }
        BlockedCommand::Retry { ids } => {
            let n = admin::retry_now(pool, schema, ids).await?;
            say!("{n} event(s) due now");
        }
    }
    Ok(())
}

/// The blocked aggregates as a table (also in `status`).
pub(super) fn print_blocked(rows: &[admin::BlockedAggregate]) -> Result<()> {
    say!(
        "{:<30} {:<38} {:>6} {:>8} {:>8}  {:<25} last error",
        "aggregate",
        "failing event",
        "seq",
        "attempts",
        "waiting",
        "next attempt"
    );
    for b in rows {
        say!(
            "{:<30} {:<38} {:>6} {:>8} {:>8}  {:<25} {}",
            format!("{}/{}", b.aggregate_type, b.aggregate_id),
            b.event_id,
            b.aggregate_seq,
            b.attempts,
            b.waiting,
            b.next_attempt_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            b.last_error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
