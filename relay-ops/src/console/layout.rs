//! The frame every page shares (header, navigation, the embedded stylesheet
//! and script), error pages, and number and time formatting.

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::Console;

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");

pub(crate) async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], CSS).into_response()
}

pub(crate) async fn js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        JS,
    )
        .into_response()
}

/// The pages in the navigation: (path, title).
const PAGES: [(&str, &str); 7] = [
    ("/", "Overview"),
    ("/dead-letters", "Dead letters"),
    ("/failures", "Failures"),
    ("/blocked", "Blocked aggregates"),
    ("/outbox", "Outbox"),
    ("/consumers", "Consumers"),
    ("/reconcile", "Reconcile"),
];

/// A whole page, or only its `<main>` content when the page's own script
/// asks for a refresh (`X-Console-Fragment`).
pub(crate) fn page(
    console: &Console,
    headers: &HeaderMap,
    here: &str,
    title: &str,
    refresh_s: Option<u64>,
    body: Markup,
) -> Response {
    if headers.contains_key("x-console-fragment") {
        return body.into_response();
    }
    let o = &console.options;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href=(console.url("/assets/console.css"));
                script src=(console.url("/assets/console.js")) defer {}
            }
            body {
                header {
                    span.brand { "outbox console" }
                    nav {
                        @for (path, name) in PAGES {
                            a href=(console.url(path)) class=[(path == here).then_some("here")] { (name) }
                        }
                    }
                    span.where {
                        @if o.read_only { span.ro { "read-only" } " " }
                        (outbox::redact::redact_url(&o.database_url)) " · schema " (console.schema.as_str())
                    }
                }
                main data-refresh=[refresh_s] { (body) }
            }
        }
    }
    .into_response()
}

/// A small page with a status: errors, refusals, 404. It has the
/// console's stylesheet (from the base path the console serves under).
pub(crate) fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    let home = super::home();
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href=(format!("{home}assets/console.css"));
            }
            body {
                header { span.brand { "outbox console" } }
                main {
                    h1 id="error-title" { (title) }
                    p id="error-message" { (user(message)) }
                    p { a href=(home) { "Back to the console" } }
                }
            }
        }
    };
    (status, markup).into_response()
}

pub(crate) async fn not_found() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        "Not found",
        "No such page in the console.",
    )
}

/// User content (names, ids, errors, headers): in a bidi isolate of its
/// own, so direction controls in it (U+202E and the like) cannot reorder
/// the text around it.
pub(crate) fn user(text: &str) -> Markup {
    html! { bdi { (text) } }
}

/// Like [`user`], cut to `max` characters with an ellipsis: lists show the
/// start, the whole value is in the tooltip and on the detail page.
pub(crate) fn user_cut(text: &str, max: usize) -> Markup {
    match text.char_indices().nth(max) {
        None => user(text),
        Some((end, _)) => html! { bdi title=(text) { (&text[..end]) "…" } },
    }
}

/// `1234567` → `1,234,567`.
pub(crate) fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Seconds as a short age: `4.2s`, `3m 05s`, `2h 10m`, `3d 4h`.
pub(crate) fn age(seconds: f64) -> String {
    let s = seconds.max(0.0);
    let whole = s as u64;
    match whole {
        0..60 => format!("{s:.1}s"),
        60..3600 => format!("{}m {:02}s", whole / 60, whole % 60),
        3600..86400 => format!("{}h {:02}m", whole / 3600, whole % 3600 / 60),
        _ => format!("{}d {}h", whole / 86400, whole % 86400 / 3600),
    }
}

/// A timestamp as the console shows it (UTC, to the second).
pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_have_thousands_separators() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(2_000_000), "2,000,000");
        assert_eq!(count(-12345), "-12,345");
    }

    #[test]
    fn ages_are_short() {
        assert_eq!(age(4.24), "4.2s");
        assert_eq!(age(185.0), "3m 05s");
        assert_eq!(age(7800.0), "2h 10m");
        assert_eq!(age(3.0 * 86400.0 + 4.0 * 3600.0), "3d 4h");
        assert_eq!(age(-1.0), "0.0s");
    }
}
