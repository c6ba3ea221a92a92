//! The list of dead letters: filter, sort (newest, oldest, most attempts),
//! page forwards and backwards, select rows or every match for an action.

use crate::admin::{self, Cursor, DeadLetter, DeadLetterPage, Filter, Order, PageAt};
use axum::extract::{Extension, Query};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use std::collections::HashMap;
use uuid::Uuid;

use super::super::Console;
use super::super::form::{Fields, bad_request};
use super::super::layout::{age, count, page, time, user, user_cut};
use super::super::security::{CSRF_FIELD, CsrfToken};
use super::super::{ConsoleState, PageResult};
use super::filter::{describe, filter_of, filter_pairs, hidden_filter, query_string};

const PAGE: i64 = 50;
/// The list and the confirmations count matches exactly up to this many.
pub(super) const COUNT_CAP: i64 = 1_000;
/// Characters of a name or id a row shows (the detail page has it all).
const NAME_SHOWN: usize = 48;
/// Characters of an error a row shows.
const ERROR_SHOWN: usize = 160;

/// What the list's URL asks for.
struct ListQuery {
    filter: Filter,
    order: Order,
    at: PageAt,
}

impl ListQuery {
    fn parse(fields: &Fields) -> Result<ListQuery, String> {
        let order = match fields.get("sort") {
            None | Some("newest") => Order::Newest,
            Some("oldest") => Order::Oldest,
            Some("attempts") => Order::MostAttempts,
            Some(other) => return Err(format!("sort: newest, oldest or attempts (got {other:?})")),
        };
        let at = match (fields.get("after"), fields.get("before")) {
            (Some(c), _) => PageAt::After(parse_cursor(c)?),
            (None, Some(c)) => PageAt::Before(parse_cursor(c)?),
            (None, None) => PageAt::First,
        };
        Ok(ListQuery {
            filter: filter_of(fields)?,
            order,
            at,
        })
    }

    /// The filter and the order as `name=value` pairs (no page).
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p = filter_pairs(&self.filter);
        match self.order {
            Order::Oldest => p.push(("sort", "oldest".to_owned())),
            Order::MostAttempts => p.push(("sort", "attempts".to_owned())),
            _ => {}
        }
        p
    }

    /// This list at another page.
    fn url(&self, console: &Console, at: Option<(&'static str, &DeadLetter)>) -> String {
        let mut p = self.pairs();
        if let Some((side, row)) = at {
            p.push((side, cursor_text(&Cursor::from(row))));
        }
        console.url(&format!("/dead-letters?{}", query_string(&p)))
    }
}

/// `<attempts>_<unix micros>_<uuid>`: a row's place in every order.
fn cursor_text(c: &Cursor) -> String {
    format!(
        "{}_{}_{}",
        c.attempts,
        c.dead_lettered_at.timestamp_micros(),
        c.id
    )
}

fn parse_cursor(text: &str) -> Result<Cursor, String> {
    let bad = || format!("not a page position ({text:?})");
    let mut parts = text.splitn(3, '_');
    let (Some(attempts), Some(micros), Some(id)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let micros: i64 = micros.parse().map_err(|_| bad())?;
    Ok(Cursor {
        attempts: attempts.parse().map_err(|_| bad())?,
        dead_lettered_at: DateTime::from_timestamp_micros(micros).ok_or_else(bad)?,
        id: Uuid::parse_str(id).map_err(|_| bad())?,
    })
}

pub(crate) async fn list(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    Query(q): Query<HashMap<String, String>>,
) -> PageResult {
    let console = &state.0;
    let q = match ListQuery::parse(&Fields::from_query(q)) {
        Ok(q) => q,
        Err(e) => return bad_request(&e),
    };
    // The page and its count at once, on two connections.
    let (rows, matching) = tokio::try_join!(
        admin::page_dead_letters(
            &console.pool,
            &console.schema,
            &q.filter,
            q.order,
            q.at,
            PAGE
        ),
        matching(console, &q.filter),
    )?;
    let body = html! {
        h1 { "Dead letters" }
        (filters(console, &q))
        (summary(console, &csrf, &q.filter, matching))
        (table(console, &csrf, &rows.rows))
        (pager(console, &q, &rows))
    };
    Ok(page(
        console,
        &headers,
        "/dead-letters",
        "Dead letters",
        None,
        body,
    ))
}

/// How many dead letters match, and whether that is approximate.
/// Unfiltered: the refresher's figure (an estimate on a big table);
/// filtered: counted through the filter's index, up to a cap.
async fn matching(console: &Console, filter: &Filter) -> crate::admin::Result<(i64, bool)> {
    if filter.is_empty() {
        let n = console.snapshot().gauges.dead_letters;
        return Ok((n, n > admin::EXACT_COUNT_UP_TO));
    }
    let selection = admin::Selection::Matching(filter.clone());
    let n = admin::count_dead_letters(
        &console.pool,
        &console.schema,
        &selection,
        Some(COUNT_CAP + 1),
    )
    .await?;
    Ok((n.min(COUNT_CAP), n > COUNT_CAP))
}

fn filters(console: &Console, q: &ListQuery) -> Markup {
    let f = &q.filter;
    let at = |t: Option<DateTime<Utc>>| t.map(|t| t.format("%Y-%m-%dT%H:%M:%S").to_string());
    let sorts = [
        ("newest", "newest first", Order::Newest),
        ("oldest", "oldest first", Order::Oldest),
        ("attempts", "most attempts", Order::MostAttempts),
    ];
    html! {
        form.filters method="get" action=(console.url("/dead-letters")) id="filters" {
            label { "event type" input name="event_type" value=[f.event_type.as_deref()]; }
            label { "aggregate type" input name="aggregate_type" value=[f.aggregate_type.as_deref()]; }
            label { "aggregate id" input name="aggregate_id" value=[f.aggregate_id.as_deref()]; }
            label { "error words" input name="error" placeholder="NO_ROUTE" value=[f.error_words.as_deref()]; }
            label { "since (UTC)" input name="since" placeholder="2026-12-01T10:00" value=[at(f.since)]; }
            label { "until (UTC)" input name="until" placeholder="2026-12-01T12:00" value=[at(f.until)]; }
            label { "sort" select name="sort" id="sort" {
                @for (value, name, order) in sorts {
                    option value=(value) selected[q.order == order] { (name) }
                }
            } }
            // Filters the form has no field for (set from the Failures page).
            @for (k, v) in filter_pairs(f).into_iter().filter(|(k, _)| matches!(*k, "error_class" | "exchange")) {
                input type="hidden" name=(k) value=(v);
            }
            button.primary type="submit" id="apply-filter" { "Filter" }
            a href=(console.url("/dead-letters")) { "Clear" }
        }
    }
}

fn summary(
    console: &Console,
    csrf: &CsrfToken,
    filter: &Filter,
    (n, approx): (i64, bool),
) -> Markup {
    html! {
        p id="matching" {
            span id="matching-count" { @if approx { "about " } (count(n)) @if approx && !filter.is_empty() { "+" } }
            @if filter.is_empty() { " dead letters in all." } @else { " dead letters match " (user(&describe(filter))) "." }
        }
        @if !console.options.read_only && n > 0 {
            form.actions method="post" action=(console.url("/dead-letters/confirm")) id="matching-actions" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="scope" value="matching";
                (hidden_filter(filter))
                button type="submit" name="action" value="replay" id="replay-matching" { "Replay all matching…" }
                button.danger type="submit" name="action" value="purge" id="purge-matching" { "Purge all matching…" }
            }
        }
    }
}

/// The rows; with actions, inside the form that acts on the selected ones.
fn table(console: &Console, csrf: &CsrfToken, rows: &[DeadLetter]) -> Markup {
    let act = !console.options.read_only;
    let table = html! {
        table.list id="dead-letter-table" {
            thead { tr {
                @if act { th { input type="checkbox" id="select-all" aria-label="select every row on this page"; } }
                th { "event" } th { "aggregate" } th { "event type" } th { "exchange" } th { "routing key" }
                th.num { "attempts" } th { "dead-lettered" } th { "last error" }
            } }
            tbody {
                @for d in rows { (row(console, d, act)) }
                @if rows.is_empty() { tr { td colspan="9" .muted { "No dead letters here." } } }
            }
        }
    };
    if !act {
        return table;
    }
    html! {
        form method="post" action=(console.url("/dead-letters/confirm")) id="selected-form" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="scope" value="ids";
            (table)
            @if !rows.is_empty() {
                div.actions {
                    button type="submit" name="action" value="replay" id="replay-selected" { "Replay selected…" }
                    button.danger type="submit" name="action" value="purge" id="purge-selected" { "Purge selected…" }
                }
            }
        }
    }
}

/// One dead letter as a list row: long values cut, each in its own isolate.
pub(super) fn row(console: &Console, d: &DeadLetter, select: bool) -> Markup {
    let now = Utc::now();
    html! {
        tr {
            @if select { td { input type="checkbox" name="ids" value=(d.id) aria-label="select"; } }
            td { a href=(console.url(&format!("/dead-letters/{}", d.id))) { code { (d.id) } } }
            td { (user_cut(&d.aggregate_type, NAME_SHOWN)) "/" (user_cut(&d.aggregate_id, NAME_SHOWN)) }
            td { (user_cut(&d.event_type, NAME_SHOWN)) }
            td { @match &d.exchange { Some(x) => (user_cut(x, NAME_SHOWN)), None => span.muted { "default" } } }
            td { @match &d.routing_key { Some(k) => (user_cut(k, NAME_SHOWN)), None => span.muted { "default" } } }
            td.num { (d.attempts) }
            td { (time(d.dead_lettered_at)) br; span.muted { (age((now - d.dead_lettered_at).as_seconds_f64())) " ago" } }
            td.err { (user_cut(&d.last_error, ERROR_SHOWN)) }
        }
    }
}

fn pager(console: &Console, q: &ListQuery, page: &DeadLetterPage) -> Markup {
    let first = page.rows.first();
    let last = page.rows.last();
    html! {
        nav.pager aria-label="pages" {
            @if page.has_previous {
                a id="first-page" href=(q.url(console, None)) { "« First" }
                @if let Some(r) = first { a id="previous-page" href=(q.url(console, Some(("before", r)))) { "‹ Previous" } }
            }
            @if page.has_next {
                @if let Some(r) = last { a id="next-page" href=(q.url(console, Some(("after", r)))) { "Next ›" } }
            }
        }
    }
}
