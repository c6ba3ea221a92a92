//! The Failures page: dead letters grouped by error class, event type and
//! exchange, with counts, share and the newest of each group; a group's
//! link opens the Dead letters page filtered to exactly that group.
//!
//! The grouping reads every dead letter (about 300 ms on 200,000), so it
//! is part of the refresher's snapshot, not of a request: the page costs
//! no query.

use std::sync::Arc;
use std::time::Instant;

use crate::admin::share;
use crate::admin::{self, Breakdown, Exchange, Failures};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox::Ident;
use sqlx::PgPool;

use super::layout::{age, count, page, time};
use super::{Console, ConsoleState, PageResult};

/// Groups shown per breakdown; the rest are summed in one row.
const TOP: i64 = 20;

/// A grouping read takes at most this share of the time between reads
/// (1/10): on a table big enough that it is slow, it is read less often
/// than the other figures rather than keep the database busy.
const READS_APART: u32 = 10;

/// The Dead letters page's `exchange` filter value for the relay's
/// default exchange (dead letters whose `exchange` is NULL). An exchange
/// actually named `(default)` cannot be picked by this filter.
pub(crate) const RELAY_DEFAULT_EXCHANGE: &str = "(default)";

/// An `exchange` filter value as the Dead letters page reads it.
pub(crate) fn exchange_of(value: &str) -> Exchange {
    if value == RELAY_DEFAULT_EXCHANGE {
        Exchange::RelayDefault
    } else {
        Exchange::Named(value.to_owned())
    }
}

/// What the Dead letters page's `exchange` filter says for `e`.
pub(crate) fn exchange_value(e: &Exchange) -> String {
    match e {
        Exchange::RelayDefault => RELAY_DEFAULT_EXCHANGE.to_owned(),
        Exchange::Named(name) => name.clone(),
    }
}

/// The grouping as last read, and when to read it again.
#[derive(Debug, Clone)]
pub(crate) struct Grouped {
    failures: Arc<Failures>,
    taken_at: DateTime<Utc>,
    read_again_at: Instant,
}

/// The grouping for the next snapshot: `previous` until it is due, else
/// read again. Due once `READS_APART` times its own read time has passed
/// (so, on a small table, at every refresh).
pub(crate) async fn refreshed(
    pool: &PgPool,
    schema: &Ident,
    previous: Option<&Grouped>,
) -> crate::admin::Result<Grouped> {
    if let Some(p) = previous.filter(|p| Instant::now() < p.read_again_at) {
        return Ok(p.clone());
    }
    let started = Instant::now();
    let failures = admin::failures(pool, schema, TOP).await?;
    Ok(Grouped {
        failures: Arc::new(failures),
        taken_at: Utc::now(),
        read_again_at: started + started.elapsed() * READS_APART,
    })
}

pub(crate) async fn groups(state: ConsoleState, headers: HeaderMap) -> PageResult {
    let console = &state.0;
    let snapshot = console.snapshot();
    let g = &snapshot.failures;
    let f = &g.failures;
    let total = f.dead_letters;
    let body = html! {
        h1 { "Failures" }
        p.muted {
            "Dead letters grouped three ways; a group's link lists its dead letters. "
            span id="failures-total" { (count(total)) } " dead letters, exact as of " (time(g.taken_at)) " UTC ("
            (age((Utc::now() - g.taken_at).as_seconds_f64())) " ago)."
        }
        @if total == 0 {
            p id="no-failures" { "No dead letters." }
        } @else {
            h2 { "By error class" }
            p.muted { "The last error with what varies between events replaced: ids by " code { "<id>" } ", quoted values by " code { "\"…\"" } ", hex strings by " code { "<hex>" } ", numbers by " code { "<n>" } "." }
            (table(console, "by-error-class", "error class", total, &f.by_error_class, |k| (k.clone(), ("error_class", k.clone()))))
            h2 { "By event type" }
            (table(console, "by-event-type", "event type", total, &f.by_event_type, |k| (k.clone(), ("event_type", k.clone()))))
            h2 { "By exchange" }
            (table(console, "by-exchange", "exchange", total, &f.by_exchange, |k| (k.to_string(), ("exchange", exchange_value(k)))))
        }
    };
    Ok(page(console, &headers, "/failures", "Failures", None, body))
}

/// One breakdown as a table: a row per group, linked to its dead letters
/// by `filter` (the shown key, and the Dead letters filter that selects
/// it), then the other groups together.
fn table<K>(
    console: &Console,
    id: &str,
    what: &str,
    total: i64,
    b: &Breakdown<K>,
    filter: impl Fn(&K) -> (String, (&'static str, String)),
) -> Markup {
    html! {
        table.failures id=(id) {
            thead { tr { th { (what) } th.num { "dead letters" } th.num { "share" } th { "newest" } } }
            tbody {
                @for group in &b.top {
                    @let (shown, pair) = filter(&group.key);
                    tr data-key=(shown) {
                        td.err {
                            // A blank value is no filter: such a group is shown, not linked.
                            @if pair.1.trim().is_empty() { (shown) } @else {
                                a.group href=(console.url(&format!("/dead-letters?{}", query(&pair)))) { (shown) }
                            }
                        }
                        td.num.count { (count(group.dead_letters)) }
                        td.num { (share(group.dead_letters, total)) }
                        td { (newest(group.newest)) }
                    }
                }
                @if let Some(o) = &b.others {
                    tr.others {
                        td.muted { (count(o.groups)) " other " (what) " groups" }
                        td.num.count { (count(o.dead_letters)) }
                        td.num { (share(o.dead_letters, total)) }
                        td { (newest(o.newest)) }
                    }
                }
            }
        }
    }
}

fn newest(t: DateTime<Utc>) -> Markup {
    html! { (time(t)) " " span.muted { (age((Utc::now() - t).as_seconds_f64())) " ago" } }
}

fn query((name, value): &(&str, String)) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair(name, value)
        .finish()
}
