//! Reading one logical decoding message of `outbox_emit` (the contract in
//! docs/WAL_CAPTURE.md) into the event the relay publishes.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::message::OutboxEvent;

/// The message format this relay reads (`"v"` of the content).
pub(crate) const FORMAT_VERSION: u32 = 1;

#[derive(Deserialize)]
struct Content<'a> {
    v: u32,
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(borrow)]
    headers: &'a RawValue,
    exchange: Option<String>,
    routing_key: Option<String>,
    aggregate_seq: Option<i64>,
    created_at: DateTime<Utc>,
}

/// A message this relay cannot publish: dead-lettered at once, with why.
#[derive(Debug, Clone)]
pub(crate) struct Unreadable {
    /// The event id when the content names one, else one derived from the
    /// message's position (the same on every replay).
    pub(crate) id: Uuid,
    /// The message's position in the log.
    pub(crate) lsn: String,
    /// The content as text (lossy UTF-8).
    pub(crate) content: String,
    /// Why it cannot be published.
    pub(crate) error: String,
}

/// The event of one message's `content`, or why it cannot be one.
pub(crate) fn decode(
    content: &[u8],
    transactional: bool,
    lsn: u64,
    prefix: &str,
) -> Result<OutboxEvent, Unreadable> {
    let unreadable = |error: String| Unreadable {
        id: id_of(content).unwrap_or_else(|| {
            Uuid::new_v5(
                &outbox::EVENT_ID_NAMESPACE,
                format!("{prefix}@{lsn}").as_bytes(),
            )
        }),
        lsn: lsn_text(lsn),
        // PostgreSQL text holds no NUL.
        content: String::from_utf8_lossy(content).replace('\0', "\u{FFFD}"),
        error,
    };
    if !transactional {
        // Decoded at once, even when its transaction rolls back: publishing
        // it could publish an event that never happened.
        return Err(unreadable(
            "a non-transactional message (pg_logical_emit_message(false, ...)): it is decoded even when its transaction rolls back, so it is not published; emit events with outbox_emit".to_owned(),
        ));
    }
    let c: Content<'_> = serde_json::from_slice(content)
        .map_err(|e| unreadable(format!("not an outbox event message: {e}")))?;
    if c.v != FORMAT_VERSION {
        return Err(unreadable(format!(
            "message format version {} is not the version {FORMAT_VERSION} this relay reads; upgrade the relay",
            c.v
        )));
    }
    for (field, value) in [
        ("aggregate_type", &c.aggregate_type),
        ("aggregate_id", &c.aggregate_id),
        ("event_type", &c.event_type),
    ] {
        if value.is_empty() {
            return Err(unreadable(format!("{field} is empty")));
        }
    }
    if !c.headers.get().starts_with('{') {
        return Err(unreadable("headers are not a JSON object".to_owned()));
    }
    if c.aggregate_seq.is_some_and(|s| s < 1) {
        return Err(unreadable("aggregate_seq is below 1".to_owned()));
    }
    let mut e = OutboxEvent::new(
        c.id,
        c.aggregate_type,
        c.aggregate_id,
        c.event_type,
        c.payload.get(),
    );
    e.headers = c.headers.get().to_owned();
    e.exchange = c.exchange;
    e.routing_key = c.routing_key;
    e.created_at = c.created_at;
    e.aggregate_seq = c.aggregate_seq;
    Ok(e)
}

/// The `id` of a JSON object content, if it has a valid one.
fn id_of(content: &[u8]) -> Option<Uuid> {
    #[derive(Deserialize)]
    struct Id {
        id: Uuid,
    }
    serde_json::from_slice::<Id>(content).ok().map(|i| i.id)
}

/// An LSN as PostgreSQL writes it (`16/B374D848`).
pub(crate) fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"v": 1, "id": "0190b6f0-0000-7000-8000-000000000001", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "OrderPlaced", "payload": {"sku": "A-1", "n": [1, 2]}, "headers": {"traceparent": "00-abc"}, "exchange": null, "routing_key": "r.k", "aggregate_seq": 3, "created_at": "2026-12-01T15:22:12.123456+00:00"}"#;

    #[test]
    fn a_message_of_outbox_emit_becomes_its_event() {
        let e = decode(GOOD.as_bytes(), true, 1, "outbox:public").unwrap();
        assert_eq!(e.id.to_string(), "0190b6f0-0000-7000-8000-000000000001");
        assert_eq!(
            (
                e.aggregate_type.as_str(),
                e.aggregate_id.as_str(),
                e.event_type.as_str()
            ),
            ("order", "o-1", "OrderPlaced")
        );
        assert_eq!(e.payload, r#"{"sku": "A-1", "n": [1, 2]}"#);
        assert_eq!(e.headers, r#"{"traceparent": "00-abc"}"#);
        assert_eq!(e.exchange, None);
        assert_eq!(e.routing_key.as_deref(), Some("r.k"));
        assert_eq!(e.aggregate_seq, Some(3));
        assert_eq!(e.attempts, 0);
        assert_eq!(e.created_at.timestamp_subsec_micros(), 123_456);
    }

    #[test]
    fn bad_messages_are_refused_with_a_reason_and_a_stable_id() {
        let cases: [(&str, bool, &str); 6] = [
            ("not json", true, "not an outbox event message"),
            (&GOOD.replace("\"v\": 1", "\"v\": 2"), true, "version 2"),
            (
                &GOOD.replace("\"o-1\"", "\"\""),
                true,
                "aggregate_id is empty",
            ),
            (
                &GOOD.replace(r#"{"traceparent": "00-abc"}"#, "[1]"),
                true,
                "headers are not a JSON object",
            ),
            (
                &GOOD.replace("\"aggregate_seq\": 3", "\"aggregate_seq\": 0"),
                true,
                "below 1",
            ),
            (GOOD, false, "non-transactional"),
        ];
        for (content, transactional, needle) in cases {
            let u = decode(
                content.as_bytes(),
                transactional,
                0x16_B374_D848,
                "outbox:s",
            )
            .unwrap_err();
            assert!(u.error.contains(needle), "{:?} for {content}", u.error);
            assert_eq!(u.lsn, "16/B374D848");
            assert_eq!(u.content, content);
            let again = decode(
                content.as_bytes(),
                transactional,
                0x16_B374_D848,
                "outbox:s",
            )
            .unwrap_err();
            assert_eq!(u.id, again.id, "a replay dead-letters the same id");
        }
    }
}
