//! `outbox-relay status`: the backlog at a glance, of one schema or of
//! every tenant's (`--all-schemas`).

use crate::admin;
use anyhow::{Context, Result};
use futures_util::StreamExt;
use outbox::{Ident, SchemaState};
use serde::Serialize;
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

/// How many tenants' statuses are read at once.
const READ_AT_ONCE: usize = 4;

/// One tenant's figures in `status --all-schemas`, or their sums.
#[derive(Debug, Default, Serialize)]
struct Figures {
    backlog: i64,
    due: i64,
    /// The oldest pending age (of all, in the totals).
    oldest_pending_age_s: Option<f64>,
    retrying: i64,
    dead_letters: i64,
    blocked_aggregates: i64,
}

impl Figures {
    fn of(s: &admin::Status) -> Self {
        Self {
            backlog: s.backlog,
            due: s.due,
            oldest_pending_age_s: s.oldest_pending_age_s,
            retrying: s.retrying,
            dead_letters: s.dead_letters,
            blocked_aggregates: s.blocked_aggregates,
        }
    }

    fn add(&mut self, other: &Self) {
        self.backlog += other.backlog;
        self.due += other.due;
        self.retrying += other.retrying;
        self.dead_letters += other.dead_letters;
        self.blocked_aggregates += other.blocked_aggregates;
        self.oldest_pending_age_s = match (self.oldest_pending_age_s, other.oldest_pending_age_s) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// One tenant's line.
#[derive(Debug, Serialize)]
struct Tenant {
    schema: String,
    #[serde(flatten)]
    figures: Figures,
}

/// `status --all-schemas`: the whole, its worst tenants, and what could
/// not be read.
#[derive(Debug, Default, Serialize)]
struct Tenants {
    /// Schemas holding the outbox.
    schemas: usize,
    /// Their sums, and the oldest pending age of all.
    totals: Figures,
    /// The tenants with the oldest pending events (then the largest
    /// backlogs), at most `--worst`.
    worst: Vec<Tenant>,
    /// Schemas not at this release's migration (not read).
    not_current: Vec<Unread>,
    /// Schemas whose status could not be read, and why.
    not_read: Vec<Unread>,
}

#[derive(Debug, Serialize)]
struct Unread {
    schema: String,
    why: String,
}

/// `outbox-relay status --all-schemas`: every current tenant's status read
/// (a few at once), summed, the worst `worst` shown.
pub(super) async fn status_many(
    pool: &PgPool,
    like: Option<&str>,
    worst: usize,
    json: bool,
) -> Result<()> {
    let census = outbox::census(pool, like)
        .await
        .context("listing the schemas that hold the outbox")?;
    let mut all = Tenants {
        schemas: census.len(),
        ..Tenants::default()
    };
    let mut current = Vec::new();
    for s in census {
        match s.state {
            SchemaState::Current(_) => current.push(s.schema),
            state => all.not_current.push(Unread {
                schema: s.schema,
                why: state.to_string(),
            }),
        }
    }
    let mut reads = futures_util::stream::iter(current)
        .map(|schema| async move {
            let status = match Ident::new("schema", &schema) {
                Ok(ident) => admin::status(pool, &ident).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            (schema, status)
        })
        .buffer_unordered(READ_AT_ONCE);
    let mut tenants = Vec::new();
    while let Some((schema, status)) = reads.next().await {
        match status {
            Ok(s) => tenants.push(Tenant {
                schema,
                figures: Figures::of(&s),
            }),
            Err(why) => all.not_read.push(Unread { schema, why }),
        }
    }
    for t in &tenants {
        all.totals.add(&t.figures);
    }
    // Oldest pending first (none last), then the largest backlog.
    tenants.sort_by(|a, b| {
        let age = |t: &Tenant| t.figures.oldest_pending_age_s.unwrap_or(-1.0);
        age(b)
            .total_cmp(&age(a))
            .then(b.figures.backlog.cmp(&a.figures.backlog))
            .then(a.schema.cmp(&b.schema))
    });
    let shown = tenants.len().min(worst);
    let rest = tenants.len() - shown;
    all.worst = tenants.into_iter().take(shown).collect();
    all.not_read.sort_by(|a, b| a.schema.cmp(&b.schema));
    if json {
        say!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    print_tenants(&all, rest)
}

fn print_tenants(all: &Tenants, rest: usize) -> Result<()> {
    let t = &all.totals;
    say!(
        "{} schemas: backlog {} ({} due), oldest pending {}, retrying {}, dead letters {}, blocked aggregates {}",
        all.schemas,
        t.backlog,
        t.due,
        age(t.oldest_pending_age_s),
        t.retrying,
        t.dead_letters,
        t.blocked_aggregates
    );
    if !all.worst.is_empty() {
        let width = all
            .worst
            .iter()
            .map(|w| w.schema.len())
            .max()
            .unwrap_or(0)
            .max(6);
        say!(
            "\n{:width$}  {:>9}  {:>9}  {:>9}  {:>8}  {:>12}  {:>7}",
            "schema",
            "backlog",
            "due",
            "oldest",
            "retrying",
            "dead letters",
            "blocked"
        );
        for w in &all.worst {
            let f = &w.figures;
            say!(
                "{:width$}  {:>9}  {:>9}  {:>9}  {:>8}  {:>12}  {:>7}",
                w.schema,
                f.backlog,
                f.due,
                age(f.oldest_pending_age_s),
                f.retrying,
                f.dead_letters,
                f.blocked_aggregates
            );
        }
        if rest > 0 {
            say!("(and {rest} more, in the totals; --worst N shows more)");
        }
    }
    for (title, list) in [
        ("not current", &all.not_current),
        ("not read", &all.not_read),
    ] {
        if !list.is_empty() {
            say!("\n{title}:");
            for u in list {
                say!("  {}  {}", u.schema, u.why);
            }
        }
    }
    Ok(())
}

fn age(s: Option<f64>) -> String {
    s.map_or("-".to_owned(), |a| format!("{a:.1}s"))
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
