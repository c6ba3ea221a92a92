//! The Dead letters page: filter and page through them, read one in full,
//! and replay or purge one, the selected, or all matching a filter, each
//! after a confirmation that says how many events it will touch.

use axum::extract::{Extension, Path};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox_relay::admin::{self, Filter, Selection};
use uuid::Uuid;

use super::form::{ActionForm, Fields, bad_request, parse_time};
use super::layout::{count, error_page, page, time, user};
use super::security::{CSRF_FIELD, CsrfToken};
use super::{ConsoleState, PageResult};

mod list;

/// Dead letters a confirmation page shows of what it will touch.
const SAMPLE: i64 = 10;

pub(crate) use list::list;

fn filter_of(f: &Fields) -> Result<Filter, String> {
    let text = |name| f.get(name).map(str::to_owned);
    let mut filter = Filter::default();
    filter.event_type = text("event_type");
    filter.aggregate_type = text("aggregate_type");
    filter.aggregate_id = text("aggregate_id");
    filter.error_words = text("error");
    filter.error_class = f.untrimmed("error_class").map(str::to_owned);
    filter.exchange = f.untrimmed("exchange").map(super::failures::exchange_of);
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
    add("error_class", f.error_class.clone());
    add(
        "exchange",
        f.exchange.as_ref().map(super::failures::exchange_value),
    );
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
            "error_class" => format!("error class = “{v}”"),
            "exchange" if v == super::failures::RELAY_DEFAULT_EXCHANGE => {
                "exchange = the relay's default".to_owned()
            }
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
            dt { "aggregate" } dd { (user(&s.aggregate_type)) " / " (user(&s.aggregate_id)) @if let Some(q) = d.aggregate_seq { " · seq " (q) } }
            dt { "event type" } dd { (user(&s.event_type)) }
            dt { "exchange" } dd { @match &s.exchange { Some(x) => (user(x)), None => "(the relay's default)" } }
            dt { "routing key" } dd { @match &s.routing_key { Some(k) => (user(k)), None => { (user(&format!("{}.{}", s.aggregate_type, s.event_type))) " (default)" } } }
            dt { "created" } dd { (time(s.created_at)) " UTC" }
            dt { "dead-lettered" } dd { (time(s.dead_lettered_at)) " UTC" }
            dt { "attempts" } dd { (s.attempts) }
            dt { "last error" } dd.err id="last-error" { (user(&s.last_error)) }
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
                @for (at, e) in &history { tr { td { (user(at)) } td.err { (user(e)) } } }
                @if history.is_empty() { tr { td colspan="2" .muted { "No earlier failures recorded." } } }
            }
        }
        h2 { "Payload" }
        pre id="payload" { bdi { (serde_json::to_string_pretty(&d.payload).unwrap_or_default()) } }
        h2 { "Headers" }
        pre id="headers" { bdi { (serde_json::to_string_pretty(&d.headers).unwrap_or_default()) } }
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

    fn verb(self) -> &'static str {
        match self {
            Action::Replay => "Replay",
            Action::Purge => "Purge",
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

/// How many dead letters a confirmation will touch: counted, or, past
/// [`list::COUNT_CAP`], more than that and about how many (from a sample
/// of the table): an exact count of a large selection reads every one of
/// its rows while the page waits.
#[derive(Debug, Clone, Copy)]
enum Counted {
    Exactly(i64),
    MoreThan { counted: i64, about: i64 },
}

impl Counted {
    async fn of(console: &super::Console, selection: &Selection) -> outbox_relay::Result<Counted> {
        let cap = list::COUNT_CAP;
        let (pool, schema) = (&console.pool, &console.schema);
        let count = admin::count_dead_letters(pool, schema, selection, Some(cap + 1));
        if let Selection::Ids(_) = selection {
            return Ok(Counted::Exactly(count.await?));
        }
        // Both at once, on two connections: the page waits for the slower.
        let estimate = admin::estimate_dead_letters(pool, schema, selection);
        let (n, about) = tokio::try_join!(count, estimate)?;
        if n <= cap {
            return Ok(Counted::Exactly(n));
        }
        Ok(Counted::MoreThan {
            counted: cap,
            about: about.max(cap + 1),
        })
    }

    /// What the action form sends back as `expected`: the count, or
    /// `more` (then the action takes every match up to the confirmed time).
    fn expected(self) -> String {
        match self {
            Counted::Exactly(n) => n.to_string(),
            Counted::MoreThan { .. } => "more".to_owned(),
        }
    }

    fn shown(self) -> Markup {
        match self {
            Counted::Exactly(n) => html! { strong { (count(n)) } },
            Counted::MoreThan { counted, about } => {
                html! { "more than " strong { (count(counted)) } " (about " (count(about)) ", from a sample)" }
            }
        }
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
    let (n, sample) = tokio::try_join!(
        Counted::of(console, &req.selection),
        admin::sample_dead_letters(&console.pool, &console.schema, &req.selection, SAMPLE),
    )?;
    let body = html! {
        h1 { (req.action.verb()) " dead letters" }
        @if matches!(n, Counted::Exactly(0)) {
            div.flash.warn id="confirm-count" data-count="0" { "Nothing to do: no dead letter matches (replayed or purged meanwhile?)." }
        } @else {
            (confirm_form(console, &req, n, &csrf))
            h2 { "What it touches" @if sample.len() as i64 == SAMPLE { " (the newest " (SAMPLE) ")" } }
            table.list id="confirm-sample" {
                thead { tr {
                    th { "event" } th { "aggregate" } th { "event type" } th { "exchange" } th { "routing key" }
                    th.num { "attempts" } th { "dead-lettered" } th { "last error" }
                } }
                tbody { @for d in &sample { (list::row(console, d, false)) } }
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

/// The count, what the action does, and the form that does it.
fn confirm_form(console: &super::Console, req: &Request, n: Counted, csrf: &CsrfToken) -> Markup {
    let purge = req.action == Action::Purge;
    let data_count = match n {
        Counted::Exactly(n) => n,
        Counted::MoreThan { about, .. } => about,
    };
    html! {
        div class=(if purge { "flash bad" } else { "flash warn" }) id="confirm-count" data-count=(data_count) {
            (req.action.verb()) " " (n.shown()) " dead letter(s): " (req.described) "."
            @if purge {
                " They are deleted for good."
            } @else {
                " They go back to the outbox with their ids, due now, attempts reset; consumers deduplicate by id."
            }
        }
        form method="post" action=(console.url("/dead-letters/act")) id="confirm-form" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="action" value=(req.action.name());
            input type="hidden" name="expected" value=(n.expected());
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
                button type="submit" id="confirm" class=(if purge { "danger" } else { "primary" }) {
                    (req.action.verb()) " " @match n {
                        Counted::Exactly(n) => { (count(n)) " event(s)" }
                        Counted::MoreThan { about, .. } => { "all matching (about " (count(about)) ")" }
                    }
                }
                a href=(console.url("/dead-letters")) { "Cancel" }
            }
        }
    }
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
    // The confirmed count, or `more`: every match up to the confirmed time.
    let expected = match fields.get("expected") {
        Some("more") if matches!(req.selection, Selection::Matching(_)) => None,
        Some(v) => match v.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return bad_request(
                    "no confirmed count: confirm the action on its confirmation page",
                );
            }
        },
        None => {
            return bad_request("no confirmed count: confirm the action on its confirmation page");
        }
    };
    let confirmed = expected.map_or_else(
        || format!("more than {}", count(list::COUNT_CAP)),
        |n| count(n as i64),
    );
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
                expected,
            )
            .await?;
            tracing::info!(
                target: "outbox_console_audit",
                who = %who.who, peer = %who.peer, action = "replay", selection = %req.described,
                reason = ?reason, confirmed = %confirmed, replayed = r.replayed, ids = ?first_ids(&r.ids),
                kept_conflicts = r.conflicts.len(), kept_unpublishable = r.unpublishable.len(),
                older_than_retention = r.older_than_retention.len(),
                "console: replayed dead letters"
            );
            html! {
                h1 { "Replayed" }
                div.flash.ok id="result" data-count=(r.replayed) {
                    "Replayed " strong { (r.replayed) } " event(s) into the outbox (" (req.described) "; confirmed " (confirmed) ")."
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
            let ids =
                admin::purge_dead_letters(&console.pool, &console.schema, &req.selection, expected)
                    .await?;
            tracing::info!(
                target: "outbox_console_audit",
                who = %who.who, peer = %who.peer, action = "purge", selection = %req.described,
                reason = ?reason, confirmed = %confirmed, purged = ids.len(), ids = ?first_ids(&ids),
                "console: purged dead letters"
            );
            html! {
                h1 { "Purged" }
                div.flash.ok id="result" data-count=(ids.len()) {
                    "Purged " strong { (ids.len()) } " dead letter(s) (" (req.described) "; confirmed " (confirmed) ")."
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
