//! One dead letter in full: where it was going, why it failed (every
//! attempt), what it carried, and the buttons to replay or purge it.

use crate::admin::{self, DeadLetterDetail};
use axum::extract::{Extension, Path};
use axum::http::{HeaderMap, StatusCode};
use maud::{Markup, html};
use uuid::Uuid;

use super::super::form::bad_request;
use super::super::layout::{error_page, page, time, user};
use super::super::security::{CSRF_FIELD, CsrfToken};
use super::super::{Console, ConsoleState, PageResult};

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
    let history = error_history(&d.error_history);
    let body = html! {
        h1 { "Dead letter " code { (d.summary.id) } }
        (facts(&d))
        @if !console.options.read_only {
            (actions(console, &csrf, d.summary.id))
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

/// The stored error history (a JSON array of `{at, error}`) as pairs;
/// anything else in it reads as empty.
fn error_history(history: &serde_json::Value) -> Vec<(String, String)> {
    history
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
        .unwrap_or_default()
}

/// Where it was going, when, and why it was dead-lettered.
fn facts(d: &DeadLetterDetail) -> Markup {
    let s = &d.summary;
    html! {
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
    }
}

/// Replay or purge this one (each asks to confirm first).
fn actions(console: &Console, csrf: &CsrfToken, id: Uuid) -> Markup {
    html! {
        form.actions method="post" action=(console.url("/dead-letters/confirm")) {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="scope" value="ids";
            input type="hidden" name="ids" value=(id);
            button type="submit" name="action" value="replay" id="replay-one" { "Replay…" }
            button.danger type="submit" name="action" value="purge" id="purge-one" { "Purge…" }
        }
    }
}
