//! The Dead letters page: filter and page through them, read one in full,
//! and replay or purge one, the selected, or all matching a filter, each
//! after a confirmation that says how many events it will touch.

use std::collections::HashMap;

use axum::extract::{Extension, Path, Query};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, NaiveDateTime, Utc};
use maud::{Markup, html};
use outbox_relay::admin::{self, Filter, PageAfter, Selection};
use uuid::Uuid;

use super::form::{ActionForm, Fields};
use super::layout::{age, count, error_page, page, time};
use super::security::{CSRF_FIELD, CsrfToken};
use super::{ConsoleState, PageResult};

const PAGE: i64 = 50;
/// The list counts matches exactly up to this many.
const COUNT_CAP: i64 = 10_000;

/// A time from a form: RFC 3339, or a browser's `datetime-local` value
/// (`2026-12-01T10:30`, read as UTC).
fn parse_time(field: &str, text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(text, f).ok())
        .map(|t| t.and_utc())
        .ok_or_else(|| format!("{field}: not a time ({text:?}); use 2026-12-01T10:30 (UTC)"))
}

fn filter_of(f: &Fields) -> Result<Filter, String> {
    let text = |name| f.get(name).map(str::to_owned);
    let mut filter = Filter::default();
    filter.event_type = text("event_type");
    filter.aggregate_type = text("aggregate_type");
    filter.aggregate_id = text("aggregate_id");
    filter.error_words = text("error");
    filter.since = f.get("since").map(|t| parse_time("since", t)).transpose()?;
    filter.until = f.get("until").map(|t| parse_time("until", t)).transpose()?;
    Ok(filter)
}

/// The filter as `name=value` pairs (times in RFC 3339).
fn filter_pairs(f: &Filter) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let mut add = |k, v: Option<String>| {
        if let Some(v) = v {
            out.push((k, v));
        }
    };
    add("event_type", f.event_type.clone());
    add("aggregate_type", f.aggregate_type.clone());
    add("aggregate_id", f.aggregate_id.clone());
    add("error", f.error_words.clone());
    add("since", f.since.map(|t| t.to_rfc3339()));
    add("until", f.until.map(|t| t.to_rfc3339()));
    out
}

fn query_string(pairs: &[(&str, String)]) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

fn hidden_filter(f: &Filter) -> Markup {
    html! {
        @for (k, v) in filter_pairs(f) { input type="hidden" name=(k) value=(v); }
    }
}

/// An RFC 3339 time as the pages show it (UTC, to the second).
fn shown(rfc3339: &str) -> String {
    DateTime::parse_from_rfc3339(rfc3339).map_or(rfc3339.to_owned(), |t| {
        format!("{} UTC", time(t.with_timezone(&Utc)))
    })
}

fn describe(f: &Filter) -> String {
    let parts: Vec<String> = filter_pairs(f)
        .into_iter()
        .map(|(k, v)| match k {
            "error" => format!("error has the words {v:?}"),
            "since" => format!("dead-lettered at or after {}", shown(&v)),
            "until" => format!("dead-lettered before {}", shown(&v)),
            _ => format!("{} = {v:?}", k.replace('_', " ")),
        })
        .collect();
    if parts.is_empty() {
        "every dead letter".to_owned()
    } else {
        parts.join(", ")
    }
}

fn bad_request(message: &str) -> PageResult {
    Ok(error_page(
        StatusCode::BAD_REQUEST,
        "Cannot do that",
        message,
    ))
}

pub(crate) async fn list(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    Query(q): Query<HashMap<String, String>>,
) -> PageResult {
    let console = &state.0;
    let fields = Fields::from_query(q);
    let filter = match filter_of(&fields) {
        Ok(f) => f,
        Err(e) => return bad_request(&e),
    };
    let after = match fields.get("after").map(parse_after).transpose() {
        Ok(a) => a,
        Err(e) => return bad_request(&e),
    };
    let rows =
        admin::search_dead_letters(&console.pool, &console.schema, &filter, after, PAGE).await?;
    // Unfiltered: the refresher's figure (an estimate on a big table);
    // filtered: counted through the filter's index, up to a cap.
    let (matching, approx) = if filter.is_empty() {
        let n = console.snapshot().gauges.dead_letters;
        (n, n > admin::status::EXACT_COUNT_UP_TO)
    } else {
        let selection = Selection::Matching(filter.clone());
        let n = admin::count_dead_letters(
            &console.pool,
            &console.schema,
            &selection,
            Some(COUNT_CAP + 1),
        )
        .await?;
        (n.min(COUNT_CAP), n > COUNT_CAP)
    };
    let pairs = filter_pairs(&filter);
    let next = rows
        .last()
        .filter(|_| rows.len() as i64 == PAGE)
        .map(|last| {
            let mut p = pairs.clone();
            p.push((
                "after",
                format!("{}_{}", last.dead_lettered_at.timestamp_micros(), last.id),
            ));
            console.url(&format!("/dead-letters?{}", query_string(&p)))
        });
    let read_only = console.options.read_only;
    let now = Utc::now();
    let body = html! {
        h1 { "Dead letters" }
        form.filters method="get" action=(console.url("/dead-letters")) id="filters" {
            label { "event type" input name="event_type" value=[filter.event_type.as_deref()]; }
            label { "aggregate type" input name="aggregate_type" value=[filter.aggregate_type.as_deref()]; }
            label { "aggregate id" input name="aggregate_id" value=[filter.aggregate_id.as_deref()]; }
            label { "error words" input name="error" placeholder="NO_ROUTE" value=[filter.error_words.as_deref()]; }
            label { "since (UTC)" input name="since" placeholder="2026-12-01T10:00" value=[filter.since.map(|t| t.format("%Y-%m-%dT%H:%M:%S").to_string())]; }
            label { "until (UTC)" input name="until" placeholder="2026-12-01T12:00" value=[filter.until.map(|t| t.format("%Y-%m-%dT%H:%M:%S").to_string())]; }
            button.primary type="submit" id="apply-filter" { "Filter" }
            a href=(console.url("/dead-letters")) { "Clear" }
        }
        p id="matching" {
            span id="matching-count" { @if approx { "about " } (count(matching)) @if approx && !filter.is_empty() { "+" } }
            @if filter.is_empty() { " dead letters in all." } @else { " dead letters match " (describe(&filter)) "." }
        }
        @if !read_only && matching > 0 {
            form.actions method="post" action=(console.url("/dead-letters/confirm")) id="matching-actions" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="scope" value="matching";
                (hidden_filter(&filter))
                button type="submit" name="action" value="replay" id="replay-matching" { "Replay all matching…" }
                button.danger type="submit" name="action" value="purge" id="purge-matching" { "Purge all matching…" }
            }
        }
        form method="post" action=(console.url("/dead-letters/confirm")) id="selected-form" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="scope" value="ids";
            table id="dead-letter-table" {
                thead { tr {
                    @if !read_only { th { "" } }
                    th { "event" } th { "aggregate" } th { "event type" } th.num { "attempts" }
                    th { "dead-lettered" } th { "last error" }
                } }
                tbody {
                    @for d in &rows {
                        tr {
                            @if !read_only { td { input type="checkbox" name="ids" value=(d.id) aria-label="select"; } }
                            td { a href=(console.url(&format!("/dead-letters/{}", d.id))) { code { (d.id) } } }
                            td { (d.aggregate_type) "/" (d.aggregate_id) }
                            td { (d.event_type) }
                            td.num { (d.attempts) }
                            td { (time(d.dead_lettered_at)) br; span.muted { (age((now - d.dead_lettered_at).as_seconds_f64())) " ago" } }
                            td.err { (d.last_error) }
                        }
                    }
                    @if rows.is_empty() { tr { td colspan="7" .muted { "No dead letters here." } } }
                }
            }
            @if !read_only && !rows.is_empty() {
                div.actions {
                    button type="submit" name="action" value="replay" id="replay-selected" { "Replay selected…" }
                    button.danger type="submit" name="action" value="purge" id="purge-selected" { "Purge selected…" }
                }
            }
        }
        div.pager {
            @if after.is_some() { a href=(console.url(&format!("/dead-letters?{}", query_string(&pairs)))) { "« First page" } }
            @if let Some(n) = next { a id="next-page" href=(n) { "Next page »" } }
        }
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

/// `<unix micros>_<uuid>`, as the "Next page" link writes it.
fn parse_after(text: &str) -> Result<PageAfter, String> {
    let bad = || format!("after: not a page position ({text:?})");
    let (micros, id) = text.split_once('_').ok_or_else(bad)?;
    let micros: i64 = micros.parse().map_err(|_| bad())?;
    Ok(PageAfter {
        dead_lettered_at: DateTime::from_timestamp_micros(micros).ok_or_else(bad)?,
        id: Uuid::parse_str(id).map_err(|_| bad())?,
    })
}

pub(crate) async fn detail(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    Path(id): Path<String>,
) -> PageResult {
    let console = &state.0;
    let Ok(id) = Uuid::parse_str(&id) else {
        return bad_request("not an event id");
    };
    let Some(d) = admin::dead_letter(&console.pool, &console.schema, id).await? else {
        return Ok(error_page(
            StatusCode::NOT_FOUND,
            "No such dead letter",
            "It was replayed or purged, or never existed.",
        ));
    };
    let history: Vec<(String, String)> = d
        .error_history
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    let field =
                        |k: &str| e.get(k).and_then(|v| v.as_str()).unwrap_or("").to_owned();
                    (field("at"), field("error"))
                })
                .collect()
        })
        .unwrap_or_default();
    let s = &d.summary;
    let body = html! {
        h1 { "Dead letter " code { (s.id) } }
        dl.kv id="dead-letter" {
            dt { "aggregate" } dd { (s.aggregate_type) " / " (s.aggregate_id) @if let Some(q) = d.aggregate_seq { " · seq " (q) } }
            dt { "event type" } dd { (s.event_type) }
            dt { "exchange" } dd { (d.exchange.as_deref().unwrap_or("(the relay's default)")) }
            dt { "routing key" } dd { (d.routing_key.clone().unwrap_or_else(|| format!("{}.{} (default)", s.aggregate_type, s.event_type))) }
            dt { "created" } dd { (time(s.created_at)) " UTC" }
            dt { "dead-lettered" } dd { (time(s.dead_lettered_at)) " UTC" }
            dt { "attempts" } dd { (s.attempts) }
            dt { "last error" } dd.err id="last-error" { (s.last_error) }
        }
        @if !console.options.read_only {
            form.actions method="post" action=(console.url("/dead-letters/confirm")) {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="scope" value="ids";
                input type="hidden" name="ids" value=(s.id);
                button type="submit" name="action" value="replay" id="replay-one" { "Replay…" }
                button.danger type="submit" name="action" value="purge" id="purge-one" { "Purge…" }
            }
        }
        h2 { "Error history (oldest first)" }
        table id="error-history" {
            thead { tr { th { "at" } th { "error" } } }
            tbody {
                @for (at, e) in &history { tr { td { (at) } td.err { (e) } } }
                @if history.is_empty() { tr { td colspan="2" .muted { "No earlier failures recorded." } } }
            }
        }
        h2 { "Payload" }
        pre id="payload" { (serde_json::to_string_pretty(&d.payload).unwrap_or_default()) }
        h2 { "Headers" }
        pre id="headers" { (serde_json::to_string_pretty(&d.headers).unwrap_or_default()) }
        p { a href=(console.url("/dead-letters")) { "« All dead letters" } }
    };
    Ok(page(
        console,
        &headers,
        "/dead-letters",
        "Dead letter",
        None,
        body,
    ))
}

/// What an action form asks for: replay or purge, and of what.
struct Request {
    action: Action,
    selection: Selection,
    /// How the selection reads, for the pages and the audit log.
    described: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Replay,
    Purge,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Purge => "purge",
        }
    }
}

fn request_of(fields: &Fields) -> Result<Request, String> {
    let action = match fields.get("action") {
        Some("replay") => Action::Replay,
        Some("purge") => Action::Purge,
        _ => return Err("no action: replay or purge".to_owned()),
    };
    match fields.get("scope") {
        Some("ids") => {
            let mut ids = fields
                .all("ids")
                .filter(|v| !v.is_empty())
                .map(|v| Uuid::parse_str(v).map_err(|_| format!("not an event id: {v:?}")))
                .collect::<Result<Vec<_>, _>>()?;
            ids.sort_unstable();
            ids.dedup();
            if ids.is_empty() {
                return Err("select at least one dead letter first".to_owned());
            }
            let described = format!("{} selected dead letter(s)", ids.len());
            Ok(Request {
                action,
                selection: Selection::Ids(ids),
                described,
            })
        }
        Some("matching") => {
            let filter = filter_of(fields)?;
            let described = format!("dead letters matching {}", describe(&filter));
            Ok(Request {
                action,
                selection: Selection::Matching(filter),
                described,
            })
        }
        _ => Err("no scope: ids or matching".to_owned()),
    }
}

/// Step one of an action: says how many dead letters it will touch and
/// asks to confirm. A filter is pinned to now (`until`), so dead letters
/// arriving later are not touched by what the operator confirmed.
pub(crate) async fn confirm(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    ActionForm { fields, .. }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let mut req = match request_of(&fields) {
        Ok(r) => r,
        Err(e) => return bad_request(&e),
    };
    if let Selection::Matching(f) = &mut req.selection {
        // The database's clock: `dead_lettered_at` is its `now()`.
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&console.pool)
            .await?;
        f.until = Some(f.until.map_or(now, |u| u.min(now)));
        req.described = format!("dead letters matching {}", describe(f));
    }
    let n = admin::count_dead_letters(&console.pool, &console.schema, &req.selection, None).await?;
    let verb = if req.action == Action::Replay {
        "Replay"
    } else {
        "Purge"
    };
    let body = html! {
        h1 { (verb) " dead letters" }
        @if n == 0 {
            div.flash.warn id="confirm-count" data-count="0" { "Nothing to do: no dead letter matches (replayed or purged meanwhile?)." }
        } @else {
            div class=(if req.action == Action::Purge { "flash bad" } else { "flash warn" }) id="confirm-count" data-count=(n) {
                (verb) " " strong { (count(n)) } " dead letter(s): " (req.described) "."
                @if req.action == Action::Replay {
                    " They go back to the outbox with their ids, due now, attempts reset; consumers deduplicate by id."
                } @else {
                    " They are deleted for good."
                }
            }
            form method="post" action=(console.url("/dead-letters/act")) id="confirm-form" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="action" value=(req.action.name());
                input type="hidden" name="expected" value=(n);
                @match &req.selection {
                    Selection::Ids(ids) => {
                        input type="hidden" name="scope" value="ids";
                        @for id in ids { input type="hidden" name="ids" value=(id); }
                    }
                    Selection::Matching(f) => {
                        input type="hidden" name="scope" value="matching";
                        (hidden_filter(f))
                    }
                    _ => {}
                }
                div.actions {
                    input #reason type="text" name="reason" required size="48" maxlength="1000"
                        placeholder="why (recorded in the audit log)";
                    button type="submit" id="confirm" class=(if req.action == Action::Purge { "danger" } else { "primary" }) {
                        (verb) " " (count(n)) " event(s)"
                    }
                    a href=(console.url("/dead-letters")) { "Cancel" }
                }
            }
        }
    };
    Ok(page(
        console,
        &headers,
        "/dead-letters",
        "Confirm",
        None,
        body,
    ))
}

/// Step two: does it, logs it, and says what happened.
pub(crate) async fn act(
    state: ConsoleState,
    headers: HeaderMap,
    ActionForm { fields, who }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let req = match request_of(&fields) {
        Ok(r) => r,
        Err(e) => return bad_request(&e),
    };
    let Some(expected) = fields.get("expected").and_then(|v| v.parse::<u64>().ok()) else {
        return bad_request("no confirmed count: confirm the action on its confirmation page");
    };
    if matches!(&req.selection, Selection::Matching(f) if f.until.is_none()) {
        return bad_request(
            "an action on a filter needs the time it was confirmed at (until): confirm it on its confirmation page",
        );
    }
    let Some(reason) = fields.get("reason").map(str::to_owned) else {
        return bad_request("say why: the reason is recorded in the audit log");
    };
    let body = match req.action {
        Action::Replay => {
            let r = admin::replay_dead_letters(
                &console.pool,
                &console.schema,
                &req.selection,
                console.options.retention,
                Some(expected),
            )
            .await?;
            tracing::info!(
                target: "outbox_console_audit",
                who = %who.who, peer = %who.peer, action = "replay", selection = %req.described,
                reason = ?reason, confirmed = expected, replayed = r.replayed, ids = ?first_ids(&r.ids),
                kept_conflicts = r.conflicts.len(), kept_unpublishable = r.unpublishable.len(),
                older_than_retention = r.older_than_retention.len(),
                "console: replayed dead letters"
            );
            html! {
                h1 { "Replayed" }
                div.flash.ok id="result" data-count=(r.replayed) {
                    "Replayed " strong { (r.replayed) } " event(s) into the outbox (" (req.described) "; confirmed " (expected) ")."
                }
                @if !r.conflicts.is_empty() {
                    div.flash.warn { "Kept " (r.conflicts.len()) " whose id is already in the outbox (enqueued again or replayed before): purge them if the outbox copy is the one to keep." }
                }
                @if !r.unpublishable.is_empty() {
                    div.flash.bad { "Kept " (r.unpublishable.len()) " the outbox refuses (a name over 255 bytes): they can never be published as they are." }
                }
                @if !r.older_than_retention.is_empty() {
                    div.flash.warn { (r.older_than_retention.len()) " replayed event(s) are older than the consumers' retention window: they may be applied again." }
                }
                p { a href=(console.url("/dead-letters")) { "« Dead letters" } " · " a href=(console.url("/")) { "Overview" } }
            }
        }
        Action::Purge => {
            let ids = admin::purge_dead_letters(
                &console.pool,
                &console.schema,
                &req.selection,
                Some(expected),
            )
            .await?;
            tracing::info!(
                target: "outbox_console_audit",
                who = %who.who, peer = %who.peer, action = "purge", selection = %req.described,
                reason = ?reason, confirmed = expected, purged = ids.len(), ids = ?first_ids(&ids),
                "console: purged dead letters"
            );
            html! {
                h1 { "Purged" }
                div.flash.ok id="result" data-count=(ids.len()) {
                    "Purged " strong { (ids.len()) } " dead letter(s) (" (req.described) "; confirmed " (expected) ")."
                }
                p { a href=(console.url("/dead-letters")) { "« Dead letters" } }
            }
        }
    };
    Ok(page(console, &headers, "/dead-letters", "Done", None, body))
}

/// The ids an audit line names: the first 20 (the line gives the count).
fn first_ids(ids: &[Uuid]) -> &[Uuid] {
    &ids[..ids.len().min(20)]
}
