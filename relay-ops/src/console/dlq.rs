//! A consumer's dead-letter queue (`<queue>.dlq`): its messages with why
//! they are there, filtered; replay (back to `<queue>`, confirmed) or
//! purge the selected or all matching, after a confirmation that counts
//! them, as the producer's dead letters are. Reading never loses,
//! loops or reorders a message (`amqp.rs`).

use std::collections::HashMap;

use axum::extract::{Extension, Query};
use axum::http::{HeaderMap, StatusCode};
use maud::{Markup, html};

use super::amqp::{DeadLetter, Held};
use super::consumers::urlencode;
use super::form::{ActionForm, Fields, bad_request, confirm_controls};
use super::layout::{count, error_page, page};
use super::security::{CSRF_FIELD, CsrfToken, Principal};
use super::{Console, ConsoleState, PageResult};

/// The list reads this many messages from the head of the queue (all of
/// them, filtered or not: only a queue held whole is renewed before its
/// messages reach a quorum queue's delivery limit).
const BROWSE: u16 = 500;
/// And shows this many of those that match.
const SHOWN: usize = 100;
/// An action reads at most this many (a bigger queue: act again).
const ACT_MAX: u16 = 10_000;

/// Which messages of a consumer's `.dlq` queue: a filter, or message ids
/// within it (the outbox table's dead letters have `admin::Filter`).
struct QueueFilter {
    queue: String,
    /// Words of the reason (case-insensitive substring).
    reason: Option<String>,
    event_type: Option<String>,
    /// Selected message ids; `None`: every match.
    ids: Option<Vec<String>>,
}

impl QueueFilter {
    fn of(console: &Console, f: &Fields) -> Result<QueueFilter, String> {
        let queue = f.get("queue").unwrap_or("").to_owned();
        if !console.options.consumers.is_queue(&queue) {
            return Err(format!("not a consumer queue of this console: {queue:?}"));
        }
        let ids = match f.get("scope") {
            Some("ids") => {
                let ids: Vec<String> = f
                    .all("ids")
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
                    .collect();
                if ids.is_empty() {
                    return Err("select at least one message first".to_owned());
                }
                Some(ids)
            }
            _ => None,
        };
        Ok(QueueFilter {
            queue,
            reason: f.get("reason_words").map(str::to_lowercase),
            event_type: f.get("event_type").map(str::to_owned),
            ids,
        })
    }

    fn matches(&self, m: &DeadLetter) -> bool {
        self.reason
            .as_ref()
            .is_none_or(|w| m.reason.to_lowercase().contains(w))
            && self.event_type.as_ref().is_none_or(|t| &m.event_type == t)
            && self
                .ids
                .as_ref()
                .is_none_or(|ids| m.message_id.as_ref().is_some_and(|id| ids.contains(id)))
    }

    fn dlq(&self) -> String {
        outbox_core::queues::dead_letter_queue(&self.queue)
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(ids) = &self.ids {
            parts.push(format!("{} selected message id(s)", ids.len()));
        }
        if let Some(w) = &self.reason {
            parts.push(format!("reason contains {w:?}"));
        }
        if let Some(t) = &self.event_type {
            parts.push(format!("event type = {t:?}"));
        }
        if parts.is_empty() {
            format!("every message in {}", self.dlq())
        } else {
            format!("messages in {} with {}", self.dlq(), parts.join(", "))
        }
    }

    fn hidden(&self) -> Markup {
        html! {
            input type="hidden" name="queue" value=(self.queue);
            @if let Some(w) = &self.reason { input type="hidden" name="reason_words" value=(w); }
            @if let Some(t) = &self.event_type { input type="hidden" name="event_type" value=(t); }
            @match &self.ids {
                Some(ids) => { input type="hidden" name="scope" value="ids"; @for id in ids { input type="hidden" name="ids" value=(id); } }
                None => { input type="hidden" name="scope" value="matching"; }
            }
        }
    }
}

pub(super) fn no_broker() -> PageResult {
    bad_request("the console has no broker: start it with --amqp-url")
}

fn table(rows: &[&DeadLetter], selectable: bool) -> Markup {
    html! {
        table id="dlq-table" {
            thead { tr { @if selectable { th { "" } } th { "message id" } th { "event type" } th { "reason" }
                th { "consumer" } th.num { "reads" } th { "body" } } }
            tbody {
                @for m in rows {
                    tr {
                        @if selectable { td { @if let Some(id) = &m.message_id {
                            input type="checkbox" name="ids" value=(id) aria-label="select";
                        } } }
                        td { code { (m.message_id.as_deref().unwrap_or("(none)")) } }
                        td { (m.event_type) }
                        td.err.reason { (m.reason) }
                        td { (m.consumer) }
                        td.num { (m.delivery_count) }
                        td { code.muted { (m.body_text) } }
                    }
                }
                @if rows.is_empty() { tr { td colspan="7" .muted { "No dead letter here." } } }
            }
        }
    }
}

pub(crate) async fn list(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    Query(q): Query<HashMap<String, String>>,
) -> PageResult {
    let console = &state.0;
    let Some(broker) = &console.consumers.broker else {
        return no_broker();
    };
    let filter = match QueueFilter::of(console, &Fields::from_query(q)) {
        Ok(f) => f,
        Err(e) => return bad_request(&e),
    };
    let held = broker.hold(&filter.dlq(), BROWSE).await?;
    let matching: Vec<&DeadLetter> = held.messages.iter().filter(|m| filter.matches(m)).collect();
    let body = list_body(console, &csrf, &filter, &held, &matching);
    held.release().await?;
    Ok(page(
        console,
        &headers,
        "/consumers",
        "Consumer dead letters",
        None,
        body,
    ))
}

fn list_body(
    console: &Console,
    csrf: &CsrfToken,
    filter: &QueueFilter,
    held: &Held,
    matching: &[&DeadLetter],
) -> Markup {
    let read_only = console.options.read_only;
    let shown = &matching[..matching.len().min(SHOWN)];
    html! {
        h1 { "Dead letters of " code { (filter.queue) } }
        form.filters method="get" action=(console.url("/consumers/dlq")) id="dlq-filters" {
            input type="hidden" name="queue" value=(filter.queue);
            label { "reason contains" input name="reason_words" placeholder="delivery_limit" value=[filter.reason.as_deref()]; }
            label { "event type" input name="event_type" value=[filter.event_type.as_deref()]; }
            button.primary type="submit" id="apply-filter" { "Filter" }
            a href=(console.url(&format!("/consumers/dlq?queue={}", urlencode(&filter.queue)))) { "Clear" }
        }
        p id="matching" {
            span id="matching-count" data-count=(matching.len()) { (count(matching.len() as i64)) }
            " of " (count(held.messages.len() as i64)) " message(s) read match"
            @if !held.whole { " (the first " (held.messages.len()) " of the queue only)" } "."
        }
        @if !read_only && !matching.is_empty() {
            form.actions method="post" action=(console.url("/consumers/dlq/confirm")) id="matching-actions" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                (QueueFilter { ids: None, queue: filter.queue.clone(), reason: filter.reason.clone(), event_type: filter.event_type.clone() }.hidden())
                button type="submit" name="action" value="replay" id="replay-matching" { "Replay all matching…" }
                button.danger type="submit" name="action" value="purge" id="purge-matching" { "Purge all matching…" }
            }
        }
        form method="post" action=(console.url("/consumers/dlq/confirm")) id="selected-form" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="queue" value=(filter.queue);
            input type="hidden" name="scope" value="ids";
            (table(shown, !read_only))
            @if !read_only && !shown.is_empty() {
                div.actions {
                    button type="submit" name="action" value="replay" id="replay-selected" { "Replay selected…" }
                    button.danger type="submit" name="action" value="purge" id="purge-selected" { "Purge selected…" }
                }
            }
        }
        p { a href=(console.url("/consumers")) { "« Consumers" } }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Replay,
    Purge,
}

/// The action and the selection a form asks for.
fn request_of(console: &Console, f: &Fields) -> Result<(Action, QueueFilter), String> {
    Ok((action_of(f)?, QueueFilter::of(console, f)?))
}

fn action_of(f: &Fields) -> Result<Action, String> {
    match f.get("action") {
        Some("replay") => Ok(Action::Replay),
        Some("purge") => Ok(Action::Purge),
        _ => Err("no action: replay or purge".to_owned()),
    }
}

/// Step one: counts what the action will touch and asks to confirm.
pub(crate) async fn confirm(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    ActionForm { fields, .. }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let Some(broker) = &console.consumers.broker else {
        return no_broker();
    };
    let (action, filter) = match request_of(console, &fields) {
        Ok(x) => x,
        Err(e) => return bad_request(&e),
    };
    let held = broker.hold(&filter.dlq(), ACT_MAX).await?;
    let n = held.messages.iter().filter(|m| filter.matches(m)).count();
    let whole = held.whole;
    held.release().await?;
    let verb = if action == Action::Replay {
        "Replay"
    } else {
        "Purge"
    };
    let body = html! {
        h1 { (verb) " consumer dead letters" }
        @if n == 0 {
            div.flash.warn id="confirm-count" data-count="0" { "Nothing to do: no message matches (replayed or purged meanwhile?)." }
        } @else {
            div class=(if action == Action::Purge { "flash bad" } else { "flash warn" }) id="confirm-count" data-count=(n) {
                (verb) " " strong { (count(n as i64)) } " message(s): " (filter.describe()) "."
                @if action == Action::Replay {
                    " Each goes back to " code { (filter.queue) } " once its copy there is confirmed; the consumer's inbox skips any it applied already."
                } @else { " They are deleted for good." }
                @if !whole { " Only the first " (ACT_MAX) " messages of the queue are read: act again for the rest." }
            }
            form method="post" action=(console.url("/consumers/dlq/act")) id="confirm-form" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                input type="hidden" name="action" value=(if action == Action::Replay { "replay" } else { "purge" });
                input type="hidden" name="expected" value=(n);
                (filter.hidden())
                (confirm_controls(&format!("{verb} {} message(s)", count(n as i64)), action == Action::Purge,
                    &console.url(&format!("/consumers/dlq?queue={}", urlencode(&filter.queue)))))
            }
        }
    };
    Ok(page(console, &headers, "/consumers", "Confirm", None, body))
}

/// Step two: does it, logs it, and says what happened. More matches than
/// were confirmed: nothing is changed.
pub(crate) async fn act(
    state: ConsoleState,
    headers: HeaderMap,
    ActionForm { fields, who }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let Some(broker) = &console.consumers.broker else {
        return no_broker();
    };
    let (action, filter) = match request_of(console, &fields) {
        Ok(x) => x,
        Err(e) => return bad_request(&e),
    };
    let Some(expected) = fields.get("expected").and_then(|v| v.parse::<usize>().ok()) else {
        return bad_request("no confirmed count: confirm the action on its confirmation page");
    };
    let Some(reason) = fields.get("reason").map(str::to_owned) else {
        return bad_request("say why: the reason is recorded in the audit log");
    };
    let held = broker.hold_to_move(&filter.dlq(), ACT_MAX).await?;
    let chosen: Vec<usize> = (0..held.messages.len())
        .filter(|&i| filter.matches(&held.messages[i]))
        .collect();
    if chosen.len() > expected {
        held.release().await?;
        let message = format!(
            "{} messages match now, {expected} were confirmed: look again and confirm the new count.",
            chosen.len()
        );
        return Ok(error_page(
            StatusCode::CONFLICT,
            "Nothing was changed",
            &message,
        ));
    }
    let ids: Vec<String> = chosen
        .iter()
        .take(20)
        .filter_map(|&i| held.messages[i].message_id.clone())
        .collect();
    let copy_to = (action == Action::Replay).then_some(filter.queue.as_str());
    // Audited whether or not it ends well: a settlement that fails late
    // (its check timed out, say) may have copied or acked messages already.
    let settled = held.settle(&chosen, copy_to).await;
    let touched = settled.as_ref().map_err(ToString::to_string).copied();
    audit(&who, action, &filter, &reason, expected, touched, &ids);
    let done = settled?;
    let verb = if action == Action::Replay {
        "Replayed"
    } else {
        "Purged"
    };
    let body = html! {
        h1 { (verb) }
        div.flash.ok id="result" data-count=(done) {
            (verb) " " strong { (done) } " message(s) (" (filter.describe()) "; confirmed " (expected) ")"
            @if action == Action::Replay { " to " code { (filter.queue) } } "."
        }
        p { a href=(console.url(&format!("/consumers/dlq?queue={}", urlencode(&filter.queue)))) { "« Dead letters of " (filter.queue) } }
    };
    Ok(page(console, &headers, "/consumers", "Done", None, body))
}

fn audit(
    who: &Principal,
    action: Action,
    filter: &QueueFilter,
    reason: &str,
    expected: usize,
    touched: std::result::Result<usize, String>,
    ids: &[String],
) {
    let action = if action == Action::Replay {
        "replay consumer dead letters"
    } else {
        "purge consumer dead letters"
    };
    match touched {
        Ok(done) => tracing::info!(
            target: "outbox_console_audit",
            who = %who.who, peer = %who.peer, action, queue = %filter.queue, selection = %filter.describe(),
            reason = ?reason, confirmed = expected, touched = done, ids = ?ids,
            "console: {action}"
        ),
        Err(error) => tracing::warn!(
            target: "outbox_console_audit",
            who = %who.who, peer = %who.peer, action, queue = %filter.queue, selection = %filter.describe(),
            reason = ?reason, confirmed = expected, error = %error, ids = ?ids,
            "console: {action} failed part way (copies may have been published, messages may have been settled): look at the queues"
        ),
    }
}
