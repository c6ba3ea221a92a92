//! The AMQP message an event becomes, written once for every part that
//! builds one: the relay's publish, the consumer's test events and the
//! console's republish ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md),
//! names in [`crate::wire`]).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::wire;

/// What the contract's properties and headers are made of, besides the
/// event's own headers.
#[derive(Debug, Clone)]
pub struct Envelope<'a> {
    /// The event id, published as `message_id`.
    pub message_id: ShortString,
    /// The event type, published as `type`.
    pub event_type: ShortString,
    /// Header `x-aggregate-type`.
    pub aggregate_type: &'a str,
    /// Header `x-aggregate-id`.
    pub aggregate_id: &'a str,
    /// Header `x-aggregate-seq`, ordered events only.
    pub aggregate_seq: Option<i64>,
    /// The event's creation, Unix seconds (`timestamp`).
    pub timestamp: u64,
}

/// The contract's properties: `own` headers first, less any of the
/// sequence's name (an event's own header must not pass for a sequence
/// number), then the aggregate headers over same-named ones, then
/// `message_id`, `type`, `content_type`, persistent delivery, `timestamp`
/// and `app_id` `outbox-relay`.
pub fn event_properties(
    e: Envelope<'_>,
    own: impl IntoIterator<Item = (ShortString, AMQPValue)>,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in own {
        if name.as_str() != wire::HEADER_AGGREGATE_SEQ {
            headers.insert(name, value);
        }
    }
    headers.insert(
        wire::HEADER_AGGREGATE_TYPE.into(),
        AMQPValue::LongString(e.aggregate_type.into()),
    );
    headers.insert(
        wire::HEADER_AGGREGATE_ID.into(),
        AMQPValue::LongString(e.aggregate_id.into()),
    );
    if let Some(seq) = e.aggregate_seq {
        headers.insert(
            wire::HEADER_AGGREGATE_SEQ.into(),
            AMQPValue::LongLongInt(seq),
        );
    }
    BasicProperties::default()
        .with_message_id(e.message_id)
        .with_type(e.event_type)
        .with_content_type(wire::CONTENT_TYPE.into())
        .with_delivery_mode(wire::DELIVERY_MODE_PERSISTENT)
        .with_timestamp(e.timestamp)
        .with_app_id("outbox-relay".into())
        .with_headers(headers)
}

/// A header value given as JSON text, as the relay publishes it: strings
/// to long strings, integers that fit 64 bits signed to long-long ints,
/// other finite numbers to doubles, booleans, null to void. Arrays,
/// objects and numbers no AMQP type holds exactly (integers past 64 bits,
/// exponents past a double) travel as their compact JSON text. Never
/// recurses, whatever the nesting.
pub fn json_header_value(raw: &str) -> AMQPValue {
    match raw.as_bytes().first() {
        Some(b'"') => match serde_json::from_str::<String>(raw) {
            Ok(s) => AMQPValue::LongString(s.into()),
            Err(_) => AMQPValue::LongString(raw.into()),
        },
        Some(b't') => AMQPValue::Boolean(true),
        Some(b'f') => AMQPValue::Boolean(false),
        Some(b'n') => AMQPValue::Void,
        Some(b'[' | b'{') => AMQPValue::LongString(compact_json(raw).into()),
        _ => {
            if let Ok(i) = raw.parse::<i64>() {
                return AMQPValue::LongLongInt(i);
            }
            let integer = !raw.contains(['.', 'e', 'E']);
            match raw.parse::<f64>() {
                Ok(f) if !integer && f.is_finite() => AMQPValue::Double(f),
                _ => AMQPValue::LongString(raw.into()),
            }
        }
    }
}

/// JSON text without the whitespace between tokens (strings untouched).
/// Iterative: any nesting depth.
fn compact_json(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in raw.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if !c.is_ascii_whitespace() {
            in_string = c == '"';
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_values_become_the_nearest_amqp_type() {
        assert_eq!(
            json_header_value(r#""a b""#),
            AMQPValue::LongString("a b".into())
        );
        assert_eq!(json_header_value("7"), AMQPValue::LongLongInt(7));
        assert_eq!(json_header_value("1.5"), AMQPValue::Double(1.5));
        assert_eq!(json_header_value("true"), AMQPValue::Boolean(true));
        assert_eq!(json_header_value("null"), AMQPValue::Void);
        assert_eq!(
            json_header_value(r#"{ "a": [1, "x y"] }"#),
            AMQPValue::LongString(r#"{"a":[1,"x y"]}"#.into())
        );
        assert_eq!(
            json_header_value("18446744073709551615"),
            AMQPValue::LongString("18446744073709551615".into())
        );
        assert_eq!(
            json_header_value("1e400"),
            AMQPValue::LongString("1e400".into())
        );
    }

    #[test]
    fn compact_json_keeps_strings_and_drops_whitespace() {
        assert_eq!(
            compact_json(r#"{"a b": [1, 2], "c": "x\" \\ ", "d": {}}"#),
            r#"{"a b":[1,2],"c":"x\" \\ ","d":{}}"#
        );
    }

    #[test]
    fn the_aggregate_headers_win_and_own_sequence_headers_are_dropped() {
        let own = [
            (
                wire::HEADER_AGGREGATE_ID.into(),
                AMQPValue::LongString("spoof".into()),
            ),
            (
                wire::HEADER_AGGREGATE_SEQ.into(),
                AMQPValue::LongLongInt(99),
            ),
            (
                "traceparent".into(),
                AMQPValue::LongString("00-a-b-01".into()),
            ),
        ];
        let p = event_properties(
            Envelope {
                message_id: "e-1".into(),
                event_type: "placed".into(),
                aggregate_type: "order",
                aggregate_id: "o-1",
                aggregate_seq: None,
                timestamp: 5,
            },
            own,
        );
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(
            h[wire::HEADER_AGGREGATE_ID],
            AMQPValue::LongString("o-1".into())
        );
        assert!(!h.contains_key(wire::HEADER_AGGREGATE_SEQ));
        assert_eq!(h["traceparent"], AMQPValue::LongString("00-a-b-01".into()));
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "e-1");
        assert_eq!(*p.timestamp(), Some(5));
    }
}
