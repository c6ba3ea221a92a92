//! Step one of an action: how many dead letters it will touch, a sample
//! of them, and the form that does it.

use crate::admin::{self, Selection};
use axum::extract::Extension;
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{Markup, html};

use super::super::form::{ActionForm, bad_request};
use super::super::layout::{count, page};
use super::super::security::{CSRF_FIELD, CsrfToken};
use super::super::{Console, ConsoleState, PageResult};
use super::filter::{describe, hidden_filter};
use super::list;
use super::request::{Action, Request, request_of};

/// Dead letters a confirmation page shows of what it will touch.
const SAMPLE: i64 = 10;

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
    async fn of(console: &Console, selection: &Selection) -> crate::admin::Result<Counted> {
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
fn confirm_form(console: &Console, req: &Request, n: Counted, csrf: &CsrfToken) -> Markup {
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
