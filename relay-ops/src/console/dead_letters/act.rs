//! Step two of an action: does it, logs it, and says what happened.

use crate::admin;
use axum::http::HeaderMap;
use maud::{Markup, html};
use uuid::Uuid;

use super::super::form::{ActionForm, bad_request};
use super::super::layout::page;
use super::super::security::Principal;
use super::super::{Console, ConsoleState, PageResult};
use super::request::{Action, Confirmed, confirmed_of};

/// Step two: does it, logs it, and says what happened.
pub(crate) async fn act(
    state: ConsoleState,
    headers: HeaderMap,
    ActionForm { fields, who }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let confirmed = match confirmed_of(&fields) {
        Ok(c) => c,
        Err(e) => return bad_request(&e),
    };
    let body = match confirmed.request.action {
        Action::Replay => replay(console, &who, &confirmed).await?,
        Action::Purge => purge(console, &who, &confirmed).await?,
    };
    Ok(page(console, &headers, "/dead-letters", "Done", None, body))
}

async fn replay(console: &Console, who: &Principal, c: &Confirmed) -> crate::admin::Result<Markup> {
    let req = &c.request;
    let (reason, confirmed) = (&c.reason, c.count());
    let r = admin::replay_dead_letters(
        &console.pool,
        &console.schema,
        &req.selection,
        console.options.retention,
        c.expected,
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
    Ok(html! {
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
    })
}

async fn purge(console: &Console, who: &Principal, c: &Confirmed) -> crate::admin::Result<Markup> {
    let req = &c.request;
    let (reason, confirmed) = (&c.reason, c.count());
    let ids = admin::purge_dead_letters(&console.pool, &console.schema, &req.selection, c.expected)
        .await?;
    tracing::info!(
        target: "outbox_console_audit",
        who = %who.who, peer = %who.peer, action = "purge", selection = %req.described,
        reason = ?reason, confirmed = %confirmed, purged = ids.len(), ids = ?first_ids(&ids),
        "console: purged dead letters"
    );
    Ok(html! {
        h1 { "Purged" }
        div.flash.ok id="result" data-count=(ids.len()) {
            "Purged " strong { (ids.len()) } " dead letter(s) (" (req.described) "; confirmed " (confirmed) ")."
        }
        p { a href=(console.url("/dead-letters")) { "« Dead letters" } }
    })
}

/// The ids an audit line names: the first 20 (the line gives the count).
fn first_ids(ids: &[Uuid]) -> &[Uuid] {
    &ids[..ids.len().min(20)]
}
