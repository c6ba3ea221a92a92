//! The Overview page (from the refresher's snapshot: no query per request)
//! and the read-only Outbox page.

use crate::admin::{self, MinuteRate};
use axum::http::HeaderMap;
use chrono::Utc;
use maud::{Markup, html};

use super::layout::{age, count, page, time, user_cut};
use super::{ConsoleState, PageResult};

pub(crate) async fn overview(state: ConsoleState, headers: HeaderMap) -> PageResult {
    let console = &state.0;
    let s = console.snapshot();
    let g = &s.gauges;
    let last_hour: i64 = s.rates.iter().map(|r| r.published).sum();
    let this_minute = s.rates.last().map_or(0, |r| r.published);
    let body = html! {
        h1 { "Overview" }
        @if s.horizon.noteworthy() {
            div.flash.warn id="horizon-held" {
                strong { "The xmin horizon is held: " } (s.horizon.describe()) ". "
                "No vacuum may remove the rows of published events until it ends; the outbox grows on disk meanwhile (the relays keep their pace). "
                "End the session if it is forgotten (" code { "pg_terminate_backend(pid)" } "). See OPERATIONS.md, \"A held xmin horizon\"."
            }
        }
        div.cards {
            (card("backlog", "Backlog", &count(g.backlog), "events in the outbox", g.backlog > 0, false))
            (card("oldest-due", "Oldest due", &age(g.oldest_due_age_s), "longest an unordered event has been due", g.oldest_due_age_s > 60.0, false))
            (card("dead-letters", "Dead letters", &count(g.dead_letters), "gave up after their attempts", false, g.dead_letters > 0))
            (card("blocked", "Blocked aggregates", &count(g.blocked_aggregates), "ordered, held by a failing head", false, g.blocked_aggregates > 0))
            (card("published-hour", "Published, last hour", &count(last_hour), &format!("{} in the current minute", count(this_minute)), false, false))
            (card("relays", "Relays", &count(s.relays.len() as i64), &format!("{} of 64 partitions unleased", s.unleased), s.relays.is_empty(), false))
            @if let Some(w) = &s.wal {
                (card("wal-lag", "Write-ahead log lag", &w.lag_bytes.map_or("-".to_owned(), bytes), &wal_note(w), !w.active, matches!(w.wal_status.as_deref(), Some("lost" | "unreserved"))))
            }
        }
        h2 { "Settled per minute, last hour " span.muted { "(published in blue, dead-lettered in red)" } }
        div.chart { (chart(&s.rates)) }
        h2 { "Relays" }
        @if s.relays.is_empty() {
            p.muted id="no-relays" { "No relay has a heartbeat in this schema." }
        } @else {
            table id="relay-table" {
                thead { tr { th { "name" } th.num { "partitions leased" } th.num { "heartbeat age" } th { "broker node" } } }
                tbody {
                    @for r in &s.relays {
                        tr {
                            td { (user_cut(&r.name, 80)) }
                            td.num { (r.partitions) }
                            td.num { (age(r.heartbeat_age_s)) }
                            td { (user_cut(r.broker.as_deref().unwrap_or("unknown"), 80)) }
                        }
                    }
                }
            }
        }
        p.muted {
            "Figures as of " (time(s.taken_at)) " UTC ("
            (age((Utc::now() - s.taken_at).as_seconds_f64())) " ago); counts above "
            (count(admin::EXACT_COUNT_UP_TO)) " rows are estimates (from the statistics, or from a sample of the table's pages when it was never analysed). This page refreshes by itself."
        }
    };
    let every = console.options.refresh.as_secs_f64().ceil().max(1.0) as u64;
    Ok(page(console, &headers, "/", "Overview", Some(every), body))
}

/// Who reads the slot, how far behind in time, and how safe its WAL is.
fn wal_note(w: &admin::WalSlot) -> String {
    let reader = match (&w.reader, w.active) {
        (Some(r), true) => format!("read by {r}"),
        (None, true) => "read by a session".to_owned(),
        (_, false) => "NO READER: the log piles up".to_owned(),
    };
    let behind = w
        .lag_s
        .map(|t| format!(", {} behind", age(t)))
        .unwrap_or_default();
    let status = match (w.wal_status.as_deref(), w.safe_wal_size) {
        (Some("lost"), _) => "; slot LOST (invalidated)".to_owned(),
        (Some(st), Some(safe)) => format!("; {st}, {} until invalidated", bytes(safe)),
        (Some(st), None) => format!("; {st}"),
        (None, _) => String::new(),
    };
    format!("slot {}: {reader}{behind}{status}", w.slot)
}

/// Bytes in the largest unit that keeps a number of at least 1.
pub(crate) fn bytes(n: i64) -> String {
    let mut v = n.max(0) as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if v < 1024.0 {
            return if unit == "B" {
                format!("{v:.0} {unit}")
            } else {
                format!("{v:.1} {unit}")
            };
        }
        v /= 1024.0;
    }
    format!("{v:.1} TiB")
}

fn card(id: &str, label: &str, value: &str, note: &str, warn: bool, bad: bool) -> Markup {
    let class = if bad {
        "card bad"
    } else if warn {
        "card warn"
    } else {
        "card"
    };
    html! {
        div class=(class) {
            div.label { (label) }
            div.value id=(id) { (value) }
            div.note { (note) }
        }
    }
}

/// Bars per minute as an inline SVG (no script, no external asset): each
/// bar is the minute's settled events, its dead-lettered part in red on top,
/// so a minute with only dead letters still shows.
fn chart(rates: &[MinuteRate]) -> Markup {
    let (w, h) = (600.0_f64, 140.0_f64);
    let settled = |r: &MinuteRate| r.published + r.dead_lettered;
    let peak = rates.iter().map(settled).max().unwrap_or(0);
    let scale = (h - 4.0) / peak.max(1) as f64;
    let bar = w / rates.len().max(1) as f64;
    html! {
        svg viewBox=(format!("0 0 {w} {}", h + 14.0)) preserveAspectRatio="none" role="img"
            aria-label="events settled per minute over the last hour" id="rate-chart" {
            line x1="0" y1=(h) x2=(w) y2=(h) stroke="#d8dde4" {}
            @for (i, r) in rates.iter().enumerate() {
                @let x = format!("{:.2}", i as f64 * bar + 1.0);
                @let width = format!("{:.2}", (bar - 2.0).max(1.0));
                @let (ok, dead) = (r.published as f64 * scale, r.dead_lettered as f64 * scale);
                g {
                    title { (r.minute.format("%H:%M")) ": " (count(r.published)) " published, " (count(r.dead_lettered)) " dead-lettered" }
                    rect.published x=(x) y=(format!("{:.2}", h - ok)) width=(width) height=(format!("{ok:.2}")) fill="#2457c5" {}
                    @if r.dead_lettered > 0 {
                        rect.dead x=(x) y=(format!("{:.2}", h - ok - dead.max(2.0))) width=(width) height=(format!("{:.2}", dead.max(2.0))) fill="#b3261e" {}
                    }
                }
            }
            text x="0" y=(h + 12.0) font-size="10" fill="#5b6675" { "-60 min" }
            text x=(w) y=(h + 12.0) font-size="10" fill="#5b6675" text-anchor="end" { "now · peak " (count(peak)) "/min" }
        }
    }
}

pub(crate) async fn outbox(state: ConsoleState, headers: HeaderMap) -> PageResult {
    let console = &state.0;
    let due = admin::oldest_due(&console.pool, &console.schema, 50).await?;
    let s = console.snapshot();
    let now = Utc::now();
    let body = html! {
        h1 { "Outbox" }
        p.muted { "Read-only. Events leave the outbox when a relay has them confirmed by the broker." }
        h2 { "Backlog by type" }
        p.muted {
            @if s.by_type.exact { "Exact counts" } @else { "Estimated from a sample of the table's pages" }
            ", as of " (time(s.taken_at)) " UTC."
        }
        table id="backlog-by-type" {
            thead { tr { th { "aggregate type" } th { "event type" } th.num { "events" } } }
            tbody {
                @for t in &s.by_type.types {
                    tr { td { (user_cut(&t.aggregate_type, 80)) } td { (user_cut(&t.event_type, 80)) } td.num { (count(t.events)) } }
                }
                @if s.by_type.types.is_empty() { tr { td colspan="3" .muted { "The outbox is empty." } } }
            }
        }
        h2 { "Due first (unordered events, in the relay's claim order)" }
        table id="oldest-due" {
            thead { tr { th { "event" } th { "aggregate" } th { "type" } th.num { "attempts" } th { "created" } th { "due" } th { "last error" } } }
            tbody {
                @for e in &due {
                    tr {
                        td { code { (e.id) } }
                        td { (user_cut(&e.aggregate_type, 60)) "/" (user_cut(&e.aggregate_id, 60)) }
                        td { (user_cut(&e.event_type, 60)) }
                        td.num { (e.attempts) }
                        td { (time(e.created_at)) }
                        td {
                            @if e.available_at <= now { "due " (age((now - e.available_at).as_seconds_f64())) " ago" }
                            @else { "in " (age((e.available_at - now).as_seconds_f64())) }
                        }
                        td.err { (user_cut(e.last_error.as_deref().unwrap_or(""), 300)) }
                    }
                }
                @if due.is_empty() { tr { td colspan="7" .muted { "No unordered event waits." } } }
            }
        }
        p.muted { "Ordered events wait in their aggregate's order; those held by a failing event are on " a href=(console.url("/blocked")) { "Blocked aggregates" } "." }
    };
    Ok(page(console, &headers, "/outbox", "Outbox", None, body))
}
