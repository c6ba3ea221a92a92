//! Reconciliation: for a consumer name and a time window, the events the
//! relay published (the archive `outbox_archive`, and version 1's `outbox_published`, kept with `run
//! --archive`) that have no inbox row for that consumer, "published, not
//! processed"; and one action that publishes them again to that
//! consumer's queue, as the relay built them (same `message_id`: the
//! inbox skips any the consumer applies meanwhile).
//!
//! Comparing a window of 100,000 events with the inbox takes longer than
//! a page may (a hash anti-join over the consumer's inbox rows: a few
//! hundred ms), so the first request for a window starts the comparison in
//! the background and the page refreshes itself until it is done; the
//! result is kept for [`FRESH`] and shown with its age. The action
//! compares again, exactly, before it publishes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Extension, Query};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outbox_core::sql::Template;
use sqlx::SqlStr;
use uuid::Uuid;

use super::form::{Fields, bad_request, parse_time};
use super::layout::{age, count, page, time};
use super::security::{CSRF_FIELD, CsrfToken};
use super::{Console, ConsoleState, PageResult, Shared};

/// How long a comparison's result is shown before it is made again.
const FRESH: Duration = Duration::from_secs(30);
/// The page lists this many of the missing events, oldest first.
const LISTED: i64 = 100;

/// The events of the window with no inbox row for `$1`, from `FROM` on
/// (a template's `{missing}`): the archive's time index (the archive by
/// day, and version 1's table a relay of an earlier release may still
/// fill), the routing key's topic pattern (`$4`, NULL: all), and
/// anti-joins with the inbox (its records, and those version 1's table
/// kept from before the consumer's migration 3). `$2` and `$3` bound the
/// window.
const MISSING: &str = include_str!("reconcile/missing.sql");

/// The missing events as the page lists them, the first [`LISTED`], each
/// with the count of all.
const LIST_MISSING: &str = include_str!("reconcile/list_missing.sql");

/// The missing events as the relay published them, the first `$5`.
pub(super) const READ_MISSING: &str = include_str!("reconcile/read_missing.sql");

/// `template` (one of the above) for the console's schema (its archive)
/// and the consumers' inbox schema.
pub(super) fn sql(console: &Console, template: &str) -> SqlStr {
    let missing = Template::new(MISSING, &console.schema)
        .with("inbox", console.options.consumers.inbox_schema.quoted())
        .text();
    Template::unqualified(template)
        .with("missing", missing)
        .with("listed", LISTED.to_string())
        .render()
}

/// A window to reconcile.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Window {
    pub(super) consumer: String,
    pub(super) since: DateTime<Utc>,
    pub(super) until: DateTime<Utc>,
    /// A topic pattern the routing key must match (the queue's binding).
    binding: Option<String>,
}

impl Window {
    pub(super) fn of(console: &Console, f: &Fields) -> Result<Option<Window>, String> {
        let Some(consumer) = f.get("consumer") else {
            return Ok(None);
        };
        if console.options.consumers.queue_of(consumer).is_none() {
            return Err(format!(
                "no queue for consumer {consumer:?}: name it with --consumer-queue {consumer}=QUEUE"
            ));
        }
        let since = parse_time("since", f.get("since").unwrap_or(""))?;
        let until = parse_time("until", f.get("until").unwrap_or(""))?;
        if since >= until {
            return Err("since must be before until".to_owned());
        }
        let binding = f.get("binding").map(str::to_owned);
        Ok(Some(Window {
            consumer: consumer.to_owned(),
            since,
            until,
            binding,
        }))
    }

    pub(super) fn pattern(&self) -> Option<String> {
        self.binding.as_deref().map(topic_regex)
    }

    pub(super) fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p = vec![
            ("consumer", self.consumer.clone()),
            ("since", self.since.to_rfc3339()),
            ("until", self.until.to_rfc3339()),
        ];
        p.extend(self.binding.clone().map(|b| ("binding", b)));
        p
    }

    pub(super) fn describe(&self) -> String {
        let routed = self
            .binding
            .as_ref()
            .map_or(String::new(), |b| format!(", routing key matching {b:?}"));
        format!(
            "published {} to {} UTC{routed}, not processed by {:?}",
            time(self.since),
            time(self.until),
            self.consumer
        )
    }
}

/// A topic binding (`order.*`, `#.paid`) as a PostgreSQL regular
/// expression over the routing key: `*` one word, `#` zero or more.
fn topic_regex(binding: &str) -> String {
    let words: Vec<&str> = binding.split('.').collect();
    let mut re = String::from("^");
    let mut dot = false;
    for (i, w) in words.iter().enumerate() {
        match *w {
            "#" if words.len() == 1 => re.push_str(".*"),
            "#" if i + 1 == words.len() => re.push_str("(\\..*)?"),
            "#" => {
                if dot {
                    re.push_str("\\.");
                }
                re.push_str("(.*\\.)?");
                dot = false;
                continue;
            }
            _ => {
                if dot {
                    re.push_str("\\.");
                }
                match *w {
                    "*" => re.push_str("[^.]+"),
                    _ => w.chars().for_each(|c| {
                        if !c.is_ascii_alphanumeric() {
                            re.push('\\');
                        }
                        re.push(c);
                    }),
                }
            }
        }
        dot = true;
    }
    re.push('$');
    re
}

/// One missing event as the page lists it.
#[derive(Debug, sqlx::FromRow)]
pub(super) struct Missing {
    id: Uuid,
    published_at: DateTime<Utc>,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    pub(super) total: i64,
}

enum Entry {
    Running,
    Done {
        at: Instant,
        took: Duration,
        rows: Arc<Vec<Missing>>,
    },
    Failed(String),
}

/// The comparisons made, by window.
#[derive(Default)]
pub(crate) struct Reconciliations(Mutex<HashMap<Window, Entry>>);

impl Reconciliations {
    /// The window's result, starting a comparison when there is none or
    /// it is older than [`FRESH`].
    pub(super) fn get_or_start(
        &self,
        console: &Shared,
        w: &Window,
    ) -> Option<(Duration, Duration, Arc<Vec<Missing>>)> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (result, start) = match map.get(w) {
            Some(Entry::Running) => (None, false),
            Some(Entry::Done { at, took, rows }) => (
                Some((at.elapsed(), *took, rows.clone())),
                at.elapsed() > FRESH,
            ),
            Some(Entry::Failed(_)) | None => (None, true),
        };
        if start {
            if result.is_none() {
                map.insert(w.clone(), Entry::Running);
            }
            tokio::spawn(compare(console.clone(), w.clone()));
        }
        result
    }

    /// Drops the window's result: after an action it is out of date.
    pub(super) fn forget(&self, w: &Window) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(w);
    }

    fn failure(&self, w: &Window) -> Option<String> {
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).get(w) {
            Some(Entry::Failed(e)) => Some(e.clone()),
            _ => None,
        }
    }
}

async fn compare(console: Shared, w: Window) {
    let started = Instant::now();
    let rows = sqlx::query_as::<_, Missing>(sql(&console, LIST_MISSING))
        .bind(&w.consumer)
        .bind(w.since)
        .bind(w.until)
        .bind(w.pattern())
        .fetch_all(&console.pool)
        .await;
    let entry = match rows {
        Ok(rows) => Entry::Done {
            at: Instant::now(),
            took: started.elapsed(),
            rows: Arc::new(rows),
        },
        Err(e) => Entry::Failed(super::scrub(&e.to_string())),
    };
    let mut map = console
        .consumers
        .reconciliations
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // Old windows go: the map holds what operators looked at lately.
    map.retain(|_, e| !matches!(e, Entry::Done { at, .. } if at.elapsed() > FRESH * 10));
    map.insert(w, entry);
}

fn window_form(console: &Console, w: Option<&Window>) -> Markup {
    let until = w.map_or_else(|| Utc::now() - chrono::Duration::minutes(5), |w| w.until);
    let since = w.map_or(until - chrono::Duration::hours(1), |w| w.since);
    let named: Vec<&str> = console
        .options
        .consumers
        .queues
        .iter()
        .filter_map(|q| q.consumer.as_deref())
        .collect();
    let fmt = |t: DateTime<Utc>| t.format("%Y-%m-%dT%H:%M:%S").to_string();
    html! {
        form.filters method="get" action=(console.url("/reconcile")) id="reconcile-form" {
            label { "consumer" select name="consumer" {
                @for c in &named { option value=(c) selected[w.is_some_and(|w| w.consumer == *c)] { (c) } }
            } }
            label { "published since (UTC)" input name="since" value=(fmt(since)); }
            label { "until (UTC)" input name="until" value=(fmt(until)); }
            label { "routing key matches" input name="binding" placeholder="order.*" value=[w.and_then(|w| w.binding.as_deref())]; }
            button.primary type="submit" id="reconcile" { "Reconcile" }
        }
        @if named.is_empty() {
            div.flash.warn id="no-consumers" { "Name a consumer and its queue with " code { "--consumer-queue CONSUMER=QUEUE" } " to reconcile it." }
        }
    }
}

pub(crate) async fn show(
    state: ConsoleState,
    headers: HeaderMap,
    Extension(csrf): Extension<CsrfToken>,
    Query(q): Query<HashMap<String, String>>,
) -> PageResult {
    let console = &state.0;
    let w = match Window::of(console, &Fields::from_query(q)) {
        Ok(w) => w,
        Err(e) => return bad_request(&e),
    };
    let result = w.as_ref().map(|w| {
        (
            w,
            console.consumers.reconciliations.get_or_start(&state.0, w),
        )
    });
    let refresh = matches!(result, Some((_, None))).then_some(1);
    let body = html! {
        h1 { "Reconcile" }
        p.muted { "Events the relay published (its archive, " code { "outbox-relay run --archive" } ") with no inbox row for the consumer. The archive must keep at least the window, the inbox too." }
        (window_form(console, w.as_ref()))
        @match &result {
            None => {}
            Some((w, None)) => {
                @if let Some(e) = console.consumers.reconciliations.failure(w) {
                    div.flash.bad id="reconcile-error" { "The comparison failed: " (e) }
                } @else {
                    p id="reconcile-running" { "Comparing the window with the inbox…" }
                }
            }
            Some((w, Some((ago, took, rows)))) => (result_body(console, &csrf, w, *ago, *took, rows)),
        }
    };
    Ok(page(
        console,
        &headers,
        "/reconcile",
        "Reconcile",
        refresh,
        body,
    ))
}

fn result_body(
    console: &Console,
    csrf: &CsrfToken,
    w: &Window,
    ago: Duration,
    took: Duration,
    rows: &[Missing],
) -> Markup {
    let total = rows.first().map_or(0, |r| r.total);
    let queue = console
        .options
        .consumers
        .queue_of(&w.consumer)
        .unwrap_or("");
    html! {
        p id="missing" data-refresh-done {
            span id="missing-count" data-count=(total) { (count(total)) } " event(s) " (w.describe()) "."
            span.muted { " Compared " (age(ago.as_secs_f64())) " ago in " (took.as_millis()) " ms." }
        }
        @if !console.options.read_only && total > 0 {
            form.actions method="post" action=(console.url("/reconcile/confirm")) id="republish-form" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf.0);
                @for (k, v) in w.pairs() { input type="hidden" name=(k) value=(v); }
                button.primary type="submit" id="republish" { "Publish them again to " (queue) "…" }
            }
        }
        table id="missing-table" {
            thead { tr { th { "event" } th { "aggregate" } th { "event type" } th { "published" } } }
            tbody {
                @for r in rows {
                    tr { td { code { (r.id) } } td { (r.aggregate_type) "/" (r.aggregate_id) } td { (r.event_type) } td { (time(r.published_at)) } }
                }
                @if rows.is_empty() { tr { td colspan="4" .muted { "Every event of the window was processed." } } }
            }
        }
        @if total > LISTED { p.muted { "The oldest " (LISTED) " are listed." } }
    }
}

#[cfg(test)]
mod tests {
    use super::topic_regex;

    #[test]
    fn topic_bindings_become_anchored_expressions() {
        assert_eq!(topic_regex("#"), "^.*$");
        assert_eq!(topic_regex("order.*"), "^order\\.[^.]+$");
        assert_eq!(topic_regex("order.#"), "^order(\\..*)?$");
        assert_eq!(topic_regex("#.paid"), "^(.*\\.)?paid$");
        assert_eq!(topic_regex("a.#.b"), "^a\\.(.*\\.)?b$");
        assert_eq!(topic_regex("a-b.c"), "^a\\-b\\.c$");
    }
}
