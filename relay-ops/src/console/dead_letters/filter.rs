//! A dead-letter filter in a form or a URL, and in words.

use crate::admin::Filter;
use chrono::{DateTime, Utc};
use maud::{Markup, html};

use super::super::form::{Fields, parse_time};
use super::super::layout::time;

pub(super) fn filter_of(f: &Fields) -> Result<Filter, String> {
    let text = |name| f.get(name).map(str::to_owned);
    Ok(Filter {
        event_type: text("event_type"),
        aggregate_type: text("aggregate_type"),
        aggregate_id: text("aggregate_id"),
        error_words: text("error"),
        error_class: f.untrimmed("error_class").map(str::to_owned),
        exchange: f
            .untrimmed("exchange")
            .map(super::super::failures::exchange_of),
        since: f.get("since").map(|t| parse_time("since", t)).transpose()?,
        until: f.get("until").map(|t| parse_time("until", t)).transpose()?,
    })
}

/// The filter as `name=value` pairs (times in RFC 3339).
pub(super) fn filter_pairs(f: &Filter) -> Vec<(&'static str, String)> {
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
        f.exchange
            .as_ref()
            .map(super::super::failures::exchange_value),
    );
    add("since", f.since.map(|t| t.to_rfc3339()));
    add("until", f.until.map(|t| t.to_rfc3339()));
    out
}

pub(super) fn query_string(pairs: &[(&str, String)]) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

pub(super) fn hidden_filter(f: &Filter) -> Markup {
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

pub(super) fn describe(f: &Filter) -> String {
    let parts: Vec<String> = filter_pairs(f)
        .into_iter()
        .map(|(k, v)| match k {
            "error" => format!("error has the words {v:?}"),
            "error_class" => format!("error class = “{v}”"),
            "exchange" if v == super::super::failures::RELAY_DEFAULT_EXCHANGE => {
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
