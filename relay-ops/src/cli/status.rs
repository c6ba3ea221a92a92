//! `outbox-relay status`: the backlog at a glance.

use crate::admin;
use anyhow::{Context, Result};
use outbox::Ident;
use sqlx::PgPool;

use super::blocked::print_blocked;
use super::emit;

pub(super) async fn status(pool: &PgPool, schema: &Ident, json: bool) -> Result<()> {
    let s = admin::status(pool, schema)
        .await
        .context("reading the outbox status")?;
    if json {
        say!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print_status(&s)?;
    }
    Ok(())
}

fn print_status(s: &admin::Status) -> Result<()> {
    let age = s
        .oldest_pending_age_s
        .map_or("-".to_owned(), |a| format!("{a:.1}s"));
    say!("{:<24}{}", "backlog", s.backlog);
    say!("{:<24}{}", "due now", s.due);
    say!("{:<24}{}", "oldest pending age", age);
    say!("{:<24}{}", "retrying", s.retrying);
    say!("{:<24}{}", "dead letters", s.dead_letters);
    say!("{:<24}{}", "blocked aggregates", s.blocked_aggregates);
    say!("{:<24}{}", "unleased partitions", s.unleased_partitions);
    let horizon = if s.horizon.noteworthy() {
        format!("HELD, {}", s.horizon.describe())
    } else {
        s.horizon.describe()
    };
    say!("{:<24}{}", "xmin horizon", horizon);
    if let Some(w) = &s.wal {
        print_wal_slot(w)?;
    }
    for r in &s.relays {
        say!(
            "  relay {:<30} {:>2} partitions, heartbeat {:.1}s ago, broker {}",
            r.name,
            r.partitions,
            r.heartbeat_age_s,
            r.broker.as_deref().unwrap_or("unknown")
        );
    }
    if !s.blocked.is_empty() {
        say!("\nblocked aggregates (oldest first):");
        print_blocked(&s.blocked)?;
    }
    if !s.failing.is_empty() {
        print_failing(&s.failing)?;
    }
    // Dead letters by error class, event type and exchange (nothing when none).
    emit(&s.failures.to_string())
}

fn print_wal_slot(w: &admin::WalSlot) -> Result<()> {
    let lag = w.lag_bytes.map_or("-".to_owned(), |b| format!("{b} bytes"));
    let reader = match (&w.reader, w.active) {
        (Some(r), true) => r.clone(),
        (None, true) => "a session".to_owned(),
        (_, false) => "NONE (no relay reads it; the WAL piles up)".to_owned(),
    };
    say!(
        "{:<24}{} ({})",
        "wal slot",
        w.slot,
        w.wal_status.as_deref().unwrap_or("?")
    );
    say!("{:<24}{}", "wal reader", reader);
    say!("{:<24}{}", "wal lag", lag);
    if let Some(t) = w.lag_s {
        say!("{:<24}{t:.3}s", "wal lag (time)");
    }
    if let Some(safe) = w.safe_wal_size {
        say!("{:<24}{safe} bytes", "wal until invalidated");
    }
    Ok(())
}

fn print_failing(failing: &[admin::FailingEvent]) -> Result<()> {
    say!("\nfailing events (most attempts first):");
    say!(
        "{:<38} {:<24} {:>8}  {:<25} last error",
        "id",
        "event type",
        "attempts",
        "next attempt"
    );
    for f in failing {
        say!(
            "{:<38} {:<24} {:>8}  {:<25} {}",
            f.id,
            f.event_type,
            f.attempts,
            f.next_attempt_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            f.last_error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
