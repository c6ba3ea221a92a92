//! Dead letters grouped by failure: by error class (the last error with
//! ids, quoted values, hex strings and numbers normalised away: migration
//! 12's `error_class`), by event type and by exchange, each group counted
//! exactly with its newest dead letter (the console's Failures page and
//! `outbox-relay status`).
//!
//! One statement reads every dead letter once (`GROUPING SETS`): about
//! 300 ms on 200,000 of them, too slow for a page request, so the console
//! reads it in its background refresher and pages show that snapshot.

use std::fmt;

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::Template;
use serde::Serialize;
use sqlx::PgPool;

use super::Result;

/// The exchange dead letters were published to, as a group or a filter
/// names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum Exchange {
    /// The relay's default exchange (`OUTBOX_EXCHANGE`): the row's
    /// `exchange` is NULL. `null` in JSON.
    RelayDefault,
    /// This exchange, named in the row.
    Named(String),
}

impl From<Option<String>> for Exchange {
    fn from(column: Option<String>) -> Self {
        column.map_or(Exchange::RelayDefault, Exchange::Named)
    }
}

impl fmt::Display for Exchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exchange::RelayDefault => f.write_str("(the relay's default)"),
            Exchange::Named(name) => f.write_str(name),
        }
    }
}

/// Dead letters by error class, by event type and by exchange.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Failures {
    /// Dead letters counted: each breakdown adds up to this.
    pub dead_letters: i64,
    /// By `error_class` (the last error, normalised: see the module).
    pub by_error_class: Breakdown<String>,
    /// By event type.
    pub by_event_type: Breakdown<String>,
    /// By exchange.
    pub by_exchange: Breakdown<Exchange>,
}

/// One way of grouping the dead letters: the largest groups, and the rest
/// together.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Breakdown<K> {
    /// The largest groups, most dead letters first (equal counts: by key).
    pub top: Vec<FailureGroup<K>>,
    /// The groups after `top`, together; `None` when `top` holds them all.
    pub others: Option<OtherGroups>,
}

/// Dead letters that share a key.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct FailureGroup<K> {
    /// The error class, event type or exchange they share.
    pub key: K,
    /// How many (exact).
    pub dead_letters: i64,
    /// When the newest of them was dead-lettered.
    pub newest: DateTime<Utc>,
}

/// The groups a [`Breakdown`] leaves out of its top, together.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct OtherGroups {
    /// How many groups.
    pub groups: i64,
    /// Their dead letters.
    pub dead_letters: i64,
    /// When the newest of them was dead-lettered.
    pub newest: DateTime<Utc>,
}

/// `GROUPING(error_class, event_type, exchange)` of each grouping set: a
/// bit per column the set leaves out.
const BY_ERROR_CLASS: i32 = 0b011;
const BY_EVENT_TYPE: i32 = 0b101;
const BY_EXCHANGE: i32 = 0b110;

/// A row of [`failures`]' statement: a top group, or (`others`) the rest
/// of its kind.
#[derive(sqlx::FromRow)]
struct Row {
    kind: i32,
    others: bool,
    key: Option<String>,
    dead_letters: i64,
    newest: DateTime<Utc>,
    groups: i64,
}

/// Counts the dead letters of `schema` by error class, event type and
/// exchange: the `top` largest groups of each, and the rest together.
/// Reads every dead letter (see the module on its cost).
pub async fn failures(pool: &PgPool, schema: &Ident, top: i64) -> Result<Failures> {
    let sql = Template::new(include_str!("failures/grouped.sql"), schema)
        .with("by_error_class", BY_ERROR_CLASS.to_string())
        .with("by_event_type", BY_EVENT_TYPE.to_string())
        .render();
    let rows: Vec<Row> = sqlx::query_as(sql).bind(top).fetch_all(pool).await?;
    let by_error_class = breakdown(&rows, BY_ERROR_CLASS, Option::unwrap_or_default);
    Ok(Failures {
        dead_letters: by_error_class.dead_letters(),
        by_error_class,
        by_event_type: breakdown(&rows, BY_EVENT_TYPE, Option::unwrap_or_default),
        by_exchange: breakdown(&rows, BY_EXCHANGE, Exchange::from),
    })
}

fn breakdown<K>(rows: &[Row], kind: i32, key: impl Fn(Option<String>) -> K) -> Breakdown<K> {
    let mut out = Breakdown {
        top: Vec::new(),
        others: None,
    };
    for r in rows.iter().filter(|r| r.kind == kind) {
        if r.others {
            out.others = Some(OtherGroups {
                groups: r.groups,
                dead_letters: r.dead_letters,
                newest: r.newest,
            });
        } else {
            out.top.push(FailureGroup {
                key: key(r.key.clone()),
                dead_letters: r.dead_letters,
                newest: r.newest,
            });
        }
    }
    out
}

impl<K> Breakdown<K> {
    /// Dead letters in all its groups.
    pub fn dead_letters(&self) -> i64 {
        let top: i64 = self.top.iter().map(|g| g.dead_letters).sum();
        top + self.others.as_ref().map_or(0, |o| o.dead_letters)
    }
}

/// `part` of `whole` in percent, one decimal (`16.7%`).
pub fn share(part: i64, whole: i64) -> String {
    format!("{:.1}%", part as f64 * 100.0 / whole.max(1) as f64)
}

/// The three breakdowns as `outbox-relay status` prints them: a table
/// each (count, share, newest, key), after a blank line; nothing when
/// there are no dead letters.
impl fmt::Display for Failures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dead_letters == 0 {
            return Ok(());
        }
        write_breakdown(f, "error class", self.dead_letters, &self.by_error_class)?;
        write_breakdown(f, "event type", self.dead_letters, &self.by_event_type)?;
        write_breakdown(f, "exchange", self.dead_letters, &self.by_exchange)
    }
}

fn write_breakdown<K: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    by: &str,
    total: i64,
    b: &Breakdown<K>,
) -> fmt::Result {
    writeln!(f, "\ndead letters by {by} (most first):")?;
    writeln!(f, "{:>10} {:>7}  {:<19}  {by}", "count", "share", "newest")?;
    let line = |f: &mut fmt::Formatter<'_>, n: i64, newest: DateTime<Utc>, what: &str| {
        let at = newest.format("%Y-%m-%d %H:%M:%S");
        writeln!(f, "{n:>10} {:>7}  {at:<19}  {what}", share(n, total))
    };
    for g in &b.top {
        line(f, g.dead_letters, g.newest, &g.key.to_string())?;
    }
    if let Some(o) = &b.others {
        let what = format!("({} other {by} groups)", o.groups);
        line(f, o.dead_letters, o.newest, &what)?;
    }
    Ok(())
}
