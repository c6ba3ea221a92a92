//! Turning an outbox row into the AMQP message of the contract
//! ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md), constants in `outbox::wire`).

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use outbox::wire;
use serde_json::value::RawValue;
use uuid::Uuid;

/// An event claimed from the outbox, as the relay publishes it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimedEvent {
    /// Event id, published as `message_id`.
    pub id: Uuid,
    /// Aggregate type (header `x-aggregate-type`).
    pub aggregate_type: String,
    /// Aggregate id (header `x-aggregate-id`).
    pub aggregate_id: String,
    /// Event type, published as `type`.
    pub event_type: String,
    /// JSON text, published as the body.
    pub payload: String,
    /// JSON object text of the event's own headers.
    pub headers: String,
    /// Exchange, `None` for the relay's default.
    pub exchange: Option<String>,
    /// Routing key, `None` for `<aggregate_type>.<event_type>`.
    pub routing_key: Option<String>,
    /// Commit-side creation time, published as `timestamp`.
    pub created_at: DateTime<Utc>,
    /// Failed attempts so far.
    pub attempts: i32,
    /// Position in its aggregate (header `x-aggregate-seq`); `None` for
    /// unordered events.
    pub aggregate_seq: Option<i64>,
}

/// An outbox row as the claim queries return it (the database's shape
/// stays private: [`ClaimedEvent`] does not promise sqlx's `FromRow`).
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimedRow {
    pub(crate) id: Uuid,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: String,
    pub(crate) event_type: String,
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) exchange: Option<String>,
    pub(crate) routing_key: Option<String>,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) attempts: i32,
    pub(crate) aggregate_seq: Option<i64>,
}

impl From<ClaimedRow> for ClaimedEvent {
    fn from(r: ClaimedRow) -> Self {
        Self {
            id: r.id,
            aggregate_type: r.aggregate_type,
            aggregate_id: r.aggregate_id,
            event_type: r.event_type,
            payload: r.payload,
            headers: r.headers,
            exchange: r.exchange,
            routing_key: r.routing_key,
            created_at: r.created_at,
            attempts: r.attempts,
            aggregate_seq: r.aggregate_seq,
        }
    }
}

/// An event as it goes on the wire: every AMQP short string checked, the
/// headers converted, the whole header frame measured.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
    pub(crate) properties: BasicProperties,
}

/// Bytes of a content header frame around its properties: frame header (7),
/// class and weight (4), body size (8), frame end (1).
const HEADER_FRAME_OVERHEAD: usize = 20;

impl ClaimedEvent {
    /// A new, never attempted, unordered event with no headers, for the
    /// relay's default exchange and routing key, created now: for code
    /// that publishes through the relay's encoding (tests, benchmarks).
    pub fn new(
        id: Uuid,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        Self {
            id,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            headers: "{}".to_owned(),
            exchange: None,
            routing_key: None,
            created_at: Utc::now(),
            attempts: 0,
            aggregate_seq: None,
        }
    }

    /// Exchange to publish to.
    pub fn exchange_or<'a>(&'a self, default: &'a str) -> &'a str {
        self.exchange.as_deref().unwrap_or(default)
    }

    /// Routing key to publish with.
    pub fn routing_key(&self) -> String {
        self.routing_key
            .clone()
            .unwrap_or_else(|| wire::default_routing_key(&self.aggregate_type, &self.event_type))
    }

    /// The AMQP properties of the contract ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md)), or why
    /// this event can never be published as it is: an AMQP short string
    /// (the `type`, a header name) over 255 bytes, or headers that are not
    /// a JSON object. Never panics, whatever the row holds.
    pub fn properties(&self) -> Result<BasicProperties, String> {
        let mut headers = FieldTable::default();
        // The event's own headers first, so the contract's aggregate headers
        // cannot be overridden by accident. Values are kept as raw JSON
        // text: nesting of any depth converts without recursion.
        let raw: std::collections::BTreeMap<String, Box<RawValue>> =
            serde_json::from_str(&self.headers)
                .map_err(|e| format!("headers are not a JSON object: {e}"))?;
        for (k, v) in raw {
            // An event's own header of the sequence's name must not pass
            // for a sequence number.
            if k == wire::HEADER_AGGREGATE_SEQ {
                continue;
            }
            let name = short("a header name", k)?;
            headers.insert(name, raw_to_amqp(v.get()));
        }
        headers.insert(
            wire::HEADER_AGGREGATE_TYPE.into(),
            AMQPValue::LongString(self.aggregate_type.as_str().into()),
        );
        headers.insert(
            wire::HEADER_AGGREGATE_ID.into(),
            AMQPValue::LongString(self.aggregate_id.as_str().into()),
        );
        if let Some(seq) = self.aggregate_seq {
            headers.insert(
                wire::HEADER_AGGREGATE_SEQ.into(),
                AMQPValue::LongLongInt(seq),
            );
        }
        Ok(BasicProperties::default()
            .with_message_id(self.id.to_string().into())
            .with_type(short("event type", self.event_type.clone())?)
            .with_content_type(wire::CONTENT_TYPE.into())
            .with_delivery_mode(wire::DELIVERY_MODE_PERSISTENT)
            .with_timestamp(self.created_at.timestamp().max(0) as u64)
            .with_app_id("outbox-relay".into())
            .with_headers(headers))
    }

    /// The whole message, or why it can never be published as it is (see
    /// [`ClaimedEvent::properties`]; also an exchange or routing key over
    /// 255 bytes, or properties that do not fit one frame of `frame_max`
    /// bytes, the size the broker negotiated).
    pub(crate) fn to_message(
        &self,
        default_exchange: &str,
        frame_max: usize,
    ) -> Result<Message, String> {
        let properties = self.properties()?;
        let exchange = short("exchange", self.exchange_or(default_exchange).to_owned())?;
        let routing_key = short("routing key", self.routing_key())?;
        let size = properties_size(&properties) + HEADER_FRAME_OVERHEAD;
        if size > frame_max {
            return Err(format!(
                "headers and properties take {size} bytes; the broker's frame size is {frame_max} bytes"
            ));
        }
        Ok(Message {
            exchange,
            routing_key,
            properties,
        })
    }
}

fn short(what: &str, v: String) -> Result<ShortString, String> {
    let len = v.len();
    ShortString::try_new(v).map_err(|_| format!("{what} is {len} bytes; AMQP allows at most 255"))
}

/// JSON header values map to the nearest AMQP field type: strings to long
/// strings, integers that fit 64 bits signed to long-long ints, other
/// finite numbers to doubles, booleans, null to void. Arrays, objects and
/// numbers no AMQP type holds exactly (integers past 64 bits, exponents
/// past a double) travel as their compact JSON text.
fn raw_to_amqp(raw: &str) -> AMQPValue {
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

/// Encoded size of `p` in a content header frame: property flags, then
/// each property present.
fn properties_size(p: &BasicProperties) -> usize {
    let short = |s: &Option<ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    2 + short(p.content_type())
        + short(p.content_encoding())
        + p.headers().as_ref().map_or(0, table_size)
        + p.delivery_mode().map_or(0, |_| 1)
        + p.priority().map_or(0, |_| 1)
        + short(p.correlation_id())
        + short(p.reply_to())
        + short(p.expiration())
        + short(p.message_id())
        + p.timestamp().map_or(0, |_| 8)
        + short(p.kind())
        + short(p.user_id())
        + short(p.app_id())
        + short(p.cluster_id())
}

fn table_size(t: &FieldTable) -> usize {
    4 + t
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + value_size(v))
        .sum::<usize>()
}

/// Type tag plus value, for the types [`raw_to_amqp`] produces (others
/// counted generously).
fn value_size(v: &AMQPValue) -> usize {
    1 + match v {
        AMQPValue::Void => 0,
        AMQPValue::Boolean(_) => 1,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::FieldTable(t) => table_size(t),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(value_size).sum::<usize>(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        _ => 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const FRAME: usize = 131_072;

    fn event(headers: &str) -> ClaimedEvent {
        ClaimedEvent {
            id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderPlaced".into(),
            payload: "{}".into(),
            headers: headers.into(),
            exchange: None,
            routing_key: None,
            created_at: Utc::now(),
            attempts: 0,
            aggregate_seq: None,
        }
    }

    #[test]
    fn properties_follow_the_contract() {
        let e = event(
            r#"{"traceparent":"00-abc-def-01","n":3,"ok":true,"x-aggregate-id":"spoof","f": 1.5, "big": 18446744073709551615, "huge": 1e400, "o": {"a": [1, "x y"]}, "z": null}"#,
        );
        let m = e.to_message("outbox.events", FRAME).unwrap();
        let p = &m.properties;
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), e.id.to_string());
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "OrderPlaced");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(*p.timestamp(), Some(e.created_at.timestamp() as u64));
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(
            h["traceparent"],
            AMQPValue::LongString("00-abc-def-01".into())
        );
        assert_eq!(h["n"], AMQPValue::LongLongInt(3));
        assert_eq!(h["ok"], AMQPValue::Boolean(true));
        assert_eq!(h["f"], AMQPValue::Double(1.5));
        assert_eq!(
            h["big"],
            AMQPValue::LongString("18446744073709551615".into())
        );
        assert_eq!(h["huge"], AMQPValue::LongString("1e400".into()));
        assert_eq!(h["o"], AMQPValue::LongString(r#"{"a":[1,"x y"]}"#.into()));
        assert_eq!(h["z"], AMQPValue::Void);
        assert_eq!(h["x-aggregate-type"], AMQPValue::LongString("order".into()));
        assert_eq!(h["x-aggregate-id"], AMQPValue::LongString("o-1".into()));
        assert!(!h.contains_key("x-aggregate-seq"), "unordered: no sequence");
        let mut ordered = event(r#"{"x-aggregate-seq": 99}"#);
        ordered.aggregate_seq = Some(7);
        let p = ordered.properties().unwrap();
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(h["x-aggregate-seq"], AMQPValue::LongLongInt(7));
        assert_eq!(m.routing_key.as_str(), "order.OrderPlaced");
        assert_eq!(m.exchange.as_str(), "outbox.events");
    }

    #[test]
    fn names_over_255_bytes_cannot_be_published() {
        let long = "x".repeat(256);
        let mut e = event("{}");
        e.event_type = long.clone();
        assert!(e.to_message("x", FRAME).unwrap_err().contains("event type"));
        let mut e = event("{}");
        e.routing_key = Some(long.clone());
        assert!(
            e.to_message("x", FRAME)
                .unwrap_err()
                .contains("routing key")
        );
        let mut e = event("{}");
        e.aggregate_type = "a".repeat(255);
        assert!(
            e.to_message("x", FRAME)
                .unwrap_err()
                .contains("routing key")
        );
        assert!(
            event("{}")
                .to_message(&long, FRAME)
                .unwrap_err()
                .contains("exchange")
        );
        let e = event(&format!("{{\"{long}\": 1}}"));
        assert!(
            e.to_message("x", FRAME)
                .unwrap_err()
                .contains("header name")
        );
        // A long key inside a nested object is only JSON text.
        let e = event(&format!("{{\"n\": {{\"{long}\": 1}}}}"));
        assert!(e.to_message("x", FRAME).is_ok());
    }

    #[test]
    fn headers_that_do_not_fit_a_frame_or_are_no_object_cannot_be_published() {
        let e = event(&format!("{{\"h\": \"{}\"}}", "v".repeat(FRAME)));
        assert!(e.to_message("x", FRAME).unwrap_err().contains("frame size"));
        assert!(e.to_message("x", 2 * FRAME).is_ok());
        for bad in ["[]", "null", "1", "", "{", "{\"a\": }"] {
            assert!(
                event(bad)
                    .to_message("x", FRAME)
                    .unwrap_err()
                    .contains("not a JSON object"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn deep_nesting_converts_without_recursion() {
        let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = event(&format!("{{\"d\": {deep}}}"));
        let p = e.properties().unwrap();
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(h["d"], AMQPValue::LongString(deep.into()));
    }

    #[test]
    fn compact_json_keeps_strings_and_drops_whitespace() {
        assert_eq!(
            compact_json(r#"{"a b": [1, 2], "c": "x\" \\ ", "d": {}}"#),
            r#"{"a b":[1,2],"c":"x\" \\ ","d":{}}"#
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn json_value() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(Value::from),
                ".{0,300}".prop_map(Value::String),
            ];
            leaf.prop_recursive(6, 64, 8, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                    prop::collection::btree_map(".{0,300}", inner, 0..8)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]

            /// No row, however odd, panics the conversion; what it accepts
            /// fits AMQP.
            #[test]
            fn any_row_converts_or_says_why(
                headers in prop::collection::btree_map(".{0,300}", json_value(), 0..6),
                exchange in proptest::option::of(".{0,300}"),
                routing_key in proptest::option::of(".{0,300}"),
                aggregate_type in ".{1,300}",
                event_type in ".{1,300}",
                seq in proptest::option::of(any::<i64>()),
                frame in 4_096usize..200_000,
            ) {
                let mut e = event(&serde_json::to_string(&headers).unwrap());
                e.exchange = exchange;
                e.routing_key = routing_key;
                e.aggregate_type = aggregate_type;
                e.event_type = event_type;
                e.aggregate_seq = seq;
                match e.to_message("outbox.events", frame) {
                    Ok(m) => {
                        prop_assert!(m.exchange.as_str().len() <= 255);
                        prop_assert!(m.routing_key.as_str().len() <= 255);
                        prop_assert!(properties_size(&m.properties) + HEADER_FRAME_OVERHEAD <= frame);
                        let h = m.properties.headers().as_ref().unwrap().inner();
                        for (k, v) in &headers {
                            if k == wire::HEADER_AGGREGATE_SEQ
                                || k == wire::HEADER_AGGREGATE_TYPE
                                || k == wire::HEADER_AGGREGATE_ID
                            {
                                continue;
                            }
                            let got = &h[k.as_str()];
                            if let Value::String(s) = v {
                                prop_assert_eq!(got, &AMQPValue::LongString(s.as_str().into()));
                            }
                            if let (Value::Array(_) | Value::Object(_), AMQPValue::LongString(t)) = (v, got) {
                                // The text as written, compact.
                                let written = serde_json::to_string(v).unwrap();
                                prop_assert_eq!(t.as_bytes(), written.as_bytes());
                            }
                        }
                    }
                    Err(why) => prop_assert!(!why.is_empty()),
                }
            }

            /// Header text that is not even JSON is refused, never a panic.
            #[test]
            fn any_header_text_is_safe(text in ".{0,400}") {
                let _ = event(&text).to_message("x", 131_072);
            }
        }
    }
}
