//! Reconciliation's action: publish the events a consumer never
//! processed again to its queue, after a confirmation that counts them.
//! The events are rebuilt as the relay built them
//! ([`OutboxEvent::properties`]), so their `message_id` is the event id
//! and the consumer's inbox skips any it processed meanwhile.

use axum::extract::Extension;
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use maud::html;
use outbox_relay::OutboxEvent;
use uuid::Uuid;

use super::consumers::urlencode;
use super::form::{ActionForm, bad_request, confirm_controls};
use super::layout::{count, error_page, page};
use super::reconcile::{READ_MISSING, Window, sql};
use super::security::{CSRF_FIELD, CsrfToken};
use super::{Console, ConsoleState, PageResult};

/// Events published per batch of confirms.
const BATCH: usize = 1000;

/// Step one of republishing: the count (from the comparison shown) and a
/// confirmation.
pub(crate) async fn confirm(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    ActionForm { fields, .. }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let w = match Window::of(console, &fields) {
        Ok(Some(w)) => w,
        Ok(None) => return bad_request("no consumer"),
        Err(e) => return bad_request(&e),
    };
    let Some((_, _, rows)) = console.consumers.reconciliations.get_or_start(&state.0, &w) else {
        return bad_request(
            "the comparison is not done yet: reload the reconciliation and confirm again",
        );
    };
    let n = rows.first().map_or(0, |r| r.total);
    let queue = console
        .options
        .consumers
        .queue_of(&w.consumer)
        .unwrap_or("");
    let body = html! {
        h1 { "Publish again" }
        div.flash.warn id="confirm-count" data-count=(n) {
            "Publish " strong { (count(n)) } " event(s) " (w.describe()) " again to queue " code { (queue) }
            ", as the relay published them (same ids: the consumer's inbox skips any it processed meanwhile)."
        }
        form method="post" action=(console.url("/reconcile/act")) id="confirm-form" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
            input type="hidden" name="expected" value=(n);
            @for (k, v) in w.pairs() { input type="hidden" name=(k) value=(v); }
            (confirm_controls(&format!("Publish {} event(s)", count(n)), false,
                &console.url(&format!("/reconcile?consumer={}", urlencode(&w.consumer)))))
        }
    };
    Ok(page(console, &headers, "/reconcile", "Confirm", None, body))
}

/// Step two: compares again, exactly, and publishes what is still
/// missing (more than confirmed: nothing).
pub(crate) async fn act(
    state: ConsoleState,
    headers: HeaderMap,
    ActionForm { fields, who }: ActionForm,
) -> PageResult {
    let console = &state.0;
    let Some(broker) = &console.consumers.broker else {
        return super::dlq::no_broker();
    };
    let w = match Window::of(console, &fields) {
        Ok(Some(w)) => w,
        Ok(None) => return bad_request("no consumer"),
        Err(e) => return bad_request(&e),
    };
    let (Some(expected), Some(reason)) = (
        fields.get("expected").and_then(|v| v.parse::<i64>().ok()),
        fields.get("reason"),
    ) else {
        return bad_request(
            "confirm on the confirmation page, with a reason (recorded in the audit log)",
        );
    };
    let events = read_missing(console, &w, expected + 1).await?;
    if events.len() as i64 > expected {
        let m = format!(
            "more than the {expected} confirmed events are missing now: reconcile again and confirm the new count"
        );
        return Ok(error_page(StatusCode::CONFLICT, "Nothing was changed", &m));
    }
    let queue = console
        .options
        .consumers
        .queue_of(&w.consumer)
        .unwrap_or("");
    let mut sent = 0;
    for batch in events.chunks(BATCH) {
        let ch = broker.channel().await?;
        let messages = batch
            .iter()
            .map(|e| e.properties().map(|p| (p, e.payload.as_bytes())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(anyhow::Error::msg)?;
        sent += super::amqp::publish(&ch, queue, messages.into_iter(), broker.timeout()).await?;
        let _ = ch.close(200, "OK".into()).await;
    }
    console.consumers.reconciliations.forget(&w);
    let ids: Vec<Uuid> = events.iter().take(20).map(|e| e.id).collect();
    tracing::info!(
        target: "outbox_console_audit",
        who = %who.who, peer = %who.peer, action = "republish", consumer = %w.consumer, queue = %queue,
        selection = %w.describe(), reason = ?reason, confirmed = expected, published = sent, ids = ?ids,
        "console: published events again to a consumer's queue"
    );
    let body = html! {
        h1 { "Published again" }
        div.flash.ok id="result" data-count=(sent) { "Published " strong { (sent) } " event(s) to " code { (queue) } " (" (w.describe()) "; confirmed " (expected) ")." }
        p { a href=(console.url(&format!("/reconcile?{}", query(&w)))) { "« Reconcile again" } }
    };
    Ok(page(console, &headers, "/reconcile", "Done", None, body))
}

pub(super) fn query(w: &Window) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in w.pairs() {
        s.append_pair(k, &v);
    }
    s.finish()
}

#[derive(sqlx::FromRow)]
struct Archived {
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: String,
    headers: String,
    exchange: Option<String>,
    routing_key: Option<String>,
    created_at: DateTime<Utc>,
    attempts: i32,
    aggregate_seq: Option<i64>,
}

/// Up to `limit` missing events, as the relay published them.
async fn read_missing(
    console: &Console,
    w: &Window,
    limit: i64,
) -> anyhow::Result<Vec<OutboxEvent>> {
    let rows = sqlx::query_as::<_, Archived>(sql(console, READ_MISSING))
        .bind(&w.consumer)
        .bind(w.since)
        .bind(w.until)
        .bind(w.pattern())
        .bind(limit)
        .fetch_all(&console.pool)
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let mut e = OutboxEvent::new(
                r.id,
                r.aggregate_type,
                r.aggregate_id,
                r.event_type,
                r.payload,
            );
            e.headers = r.headers;
            e.exchange = r.exchange;
            e.routing_key = r.routing_key;
            e.created_at = r.created_at;
            e.attempts = r.attempts;
            e.aggregate_seq = r.aggregate_seq;
            e
        })
        .collect())
}
