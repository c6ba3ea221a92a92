//! The Blocked aggregates page (ordered events): each aggregate's failing
//! head, its error and the events waiting behind it; retry the head now,
//! or skip it to the dead letters with a required reason.

use crate::admin::{self, BlockedAggregate, WaitingEvent};
use axum::extract::Extension;
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use uuid::Uuid;

use super::form::ActionForm;
use super::layout::{age, count, error_page, page, time, user, user_cut};
use super::security::{CSRF_FIELD, CsrfToken};
use super::{Console, ConsoleState, PageResult};

const LIMIT: i64 = 100;
const WAITING_SHOWN: i64 = 5;

pub(crate) async fn list(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
) -> PageResult {
    let console = &state.0;
    let blocked = admin::blocked_aggregates(&console.pool, &console.schema, LIMIT).await?;
    let keys: Vec<(String, String)> = blocked
        .iter()
        .map(|b| (b.aggregate_type.clone(), b.aggregate_id.clone()))
        .collect();
    let waiting =
        admin::waiting_events(&console.pool, &console.schema, &keys, WAITING_SHOWN).await?;
    let total = console.snapshot().gauges.blocked_aggregates;
    let now = Utc::now();
    let body = html! {
        h1 { "Blocked aggregates" }
        p.muted {
            "An ordered aggregate whose oldest event keeps failing: the events behind it wait until it is delivered or skipped. "
            "Skipping moves it to the dead letters (consumers see a gap in the aggregate's sequence; it can be replayed later). "
            span id="blocked-count" { (count(total)) } " blocked now"
            @if total > LIMIT { ", the oldest " (LIMIT) " shown" } "."
        }
        @if blocked.is_empty() {
            p id="no-blocked" { "No aggregate is blocked." }
        }
        @for b in &blocked {
            (card(console, &csrf, b, &waiting, now))
        }
    };
    Ok(page(
        console,
        &headers,
        "/blocked",
        "Blocked aggregates",
        None,
        body,
    ))
}

/// One blocked aggregate: its failing head, what waits behind it, and
/// (unless read-only) the buttons to retry or skip the head.
fn card(
    console: &Console,
    csrf: &CsrfToken,
    b: &BlockedAggregate,
    waiting: &[WaitingEvent],
    now: DateTime<Utc>,
) -> Markup {
    html! {
        div.card.blocked data-aggregate=(format!("{}/{}", b.aggregate_type, b.aggregate_id)) {
            h2 { (user_cut(&b.aggregate_type, 80)) " / " (user_cut(&b.aggregate_id, 120)) }
            dl.kv {
                dt { "failing event" } dd { code.event-id { (b.event_id) } " · seq " (b.aggregate_seq) }
                dt { "attempts" } dd { (b.attempts) }
                dt { "last error" } dd.err { (user(b.last_error.as_deref().unwrap_or(""))) }
                dt { "next attempt" } dd {
                    @if b.next_attempt_at <= now { "due now" } @else { "in " (age((b.next_attempt_at - now).as_seconds_f64())) }
                    " (" (time(b.next_attempt_at)) " UTC)"
                }
                dt { "waiting behind it" } dd { (behind(b, waiting)) }
            }
            @if !console.options.read_only {
                (head_actions(console, csrf, b.event_id))
            }
        }
    }
}

/// How many events wait behind the head, and the first of them.
fn behind(b: &BlockedAggregate, waiting: &[WaitingEvent]) -> Markup {
    let behind: Vec<_> = waiting
        .iter()
        .filter(|w| w.aggregate_type == b.aggregate_type && w.aggregate_id == b.aggregate_id)
        .collect();
    html! {
        (count(b.waiting)) @if b.waiting >= admin::WAITING_COUNTED_UP_TO { "+" } " event(s)"
        @if !behind.is_empty() {
            ": "
            @for (i, w) in behind.iter().enumerate() {
                @if i > 0 { ", " }
                "#" (w.aggregate_seq) " " (user_cut(&w.event_type, 60))
            }
            @if b.waiting > behind.len() as i64 { ", …" }
        }
    }
}

/// Retry the failing head now, or skip it (a reason required).
fn head_actions(console: &Console, csrf: &CsrfToken, event_id: Uuid) -> Markup {
    html! {
        div.actions {
            form method="post" action=(console.url("/blocked/act")) {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="id" value=(event_id);
                button.retry type="submit" name="action" value="retry" { "Retry now" }
            }
            form method="post" action=(console.url("/blocked/act")) {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="id" value=(event_id);
                input type="hidden" name="action" value="skip";
                input.reason type="text" name="reason" placeholder="why skip it (required)" size="36" maxlength="1000";
                " "
                button.danger.skip type="submit" { "Skip to dead letters" }
            }
        }
    }
}

pub(crate) async fn act(
    state: ConsoleState,
    headers: HeaderMap,
    ActionForm { fields, who }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let Some(id) = fields.get("id").and_then(|v| Uuid::parse_str(v).ok()) else {
        return Ok(error_page(
            StatusCode::BAD_REQUEST,
            "Cannot do that",
            "no event id",
        ));
    };
    let message = match fields.get("action") {
        Some("retry") => {
            let n = admin::retry_now(&console.pool, &console.schema, &[id]).await?;
            tracing::info!(target: "outbox_console_audit", who = %who.who, peer = %who.peer, action = "retry", event_id = %id, reason = ?fields.get("reason"), rescheduled = n, "console: retry a blocked aggregate's head now");
            if n == 1 {
                format!("Event {id} is due now: a relay tries it at its next claim.")
            } else {
                format!(
                    "Event {id} was not waiting for a retry (delivered, skipped, or due already)."
                )
            }
        }
        Some("skip") => {
            let Some(reason) = fields.get("reason") else {
                return Ok(error_page(
                    StatusCode::BAD_REQUEST,
                    "A reason is required",
                    "Say why the event is skipped: it is recorded as the dead letter's error and in the audit log.",
                ));
            };
            let n = admin::skip_events(&console.pool, &console.schema, &[id], reason).await?;
            tracing::info!(target: "outbox_console_audit", who = %who.who, peer = %who.peer, action = "skip", event_id = %id, reason = ?reason, skipped = n, "console: skipped a blocked aggregate's head to the dead letters");
            if n == 1 {
                format!("Event {id} moved to the dead letters; its aggregate moves on.")
            } else {
                format!("Event {id} is no longer in the outbox (delivered or skipped already).")
            }
        }
        _ => {
            return Ok(error_page(
                StatusCode::BAD_REQUEST,
                "Cannot do that",
                "no action: retry or skip",
            ));
        }
    };
    let body = html! {
        h1 { "Blocked aggregates" }
        div.flash.ok id="result" { (message) }
        p { a href=(console.url("/blocked")) { "« Blocked aggregates" } }
    };
    Ok(page(console, &headers, "/blocked", "Done", None, body))
}
