//! `outbox-relay dead-letters`: list, replay or purge the events that
//! exhausted their attempts.

use std::time::Duration;

use crate::admin::{self, Replayed};
use anyhow::Result;
use outbox::Ident;
use sqlx::PgPool;
use uuid::Uuid;

use super::args::DeadLetterCommand;

pub(super) async fn dead_letters(
    pool: &PgPool,
    schema: &Ident,
    cmd: &DeadLetterCommand,
) -> Result<()> {
    match cmd {
        DeadLetterCommand::List { limit, json } => {
            let rows = admin::list_dead_letters(pool, schema, *limit).await?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                say!("no dead letters");
            } else {
                print_dead_letters(&rows)?;
            }
        }
        DeadLetterCommand::Replay { target, retention } => {
            let r = admin::replay_dead_letters(pool, schema, &target.selection(), *retention, None)
                .await?;
            say!("replayed {} event(s) into the outbox", r.replayed);
            warn_kept(&r, *retention);
        }
        DeadLetterCommand::Purge { target } => {
            let ids = admin::purge_dead_letters(pool, schema, &target.selection(), None).await?;
            say!("purged {} dead letter(s)", ids.len());
        }
    }
    Ok(())
}

fn print_dead_letters(rows: &[admin::DeadLetter]) -> Result<()> {
    say!(
        "{:<38} {:<24} {:>8}  {:<20} last error",
        "id",
        "event type",
        "attempts",
        "dead-lettered at"
    );
    for d in rows {
        say!(
            "{:<38} {:<24} {:>8}  {:<20} {}",
            d.id,
            d.event_type,
            d.attempts,
            d.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
            d.last_error
        );
    }
    Ok(())
}

/// On stderr: the dead letters a replay kept, and the replayed events
/// consumers may have forgotten.
fn warn_kept(r: &Replayed, retention: Duration) {
    if !r.conflicts.is_empty() {
        eprintln!(
            "kept {} dead letter(s) whose id is already in the outbox (enqueued again or replayed before); purge them if the outbox copy is the one to keep: {}",
            r.conflicts.len(),
            some_ids(&r.conflicts)
        );
    }
    if !r.unpublishable.is_empty() {
        eprintln!(
            "kept {} dead letter(s) the outbox refuses (a name over 255 bytes); they can never be published as they are: {}",
            r.unpublishable.len(),
            some_ids(&r.unpublishable)
        );
    }
    if !r.older_than_retention.is_empty() {
        eprintln!(
            "warning: {} replayed event(s) are older than the retention window ({}); consumers may apply them again: {}",
            r.older_than_retention.len(),
            humantime::format_duration(retention),
            some_ids(&r.older_than_retention)
        );
    }
}

/// The first 20 of `ids`, and how many more (a replay of every dead letter
/// may name hundreds of thousands).
fn some_ids(ids: &[Uuid]) -> String {
    let shown: Vec<String> = ids.iter().take(20).map(Uuid::to_string).collect();
    match ids.len().saturating_sub(shown.len()) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}
