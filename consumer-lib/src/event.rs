use std::borrow::Cow;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use outbox::wire;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::config::DedupKey;

/// Header counting how many times a sequenced event was deferred (sent back
/// through the retry queue because of a sequence gap, or held back behind a
/// failed earlier event of its aggregate), set by an ordered consumer on
/// the copy it republishes. Separate from `x-retry-count`
/// ([`outbox::wire::HEADER_RETRY_COUNT`]), which counts the handler's
/// retries only; see [`ConsumerConfig::max_deferrals`](crate::ConsumerConfig::max_deferrals).
pub const HEADER_DEFERRAL_COUNT: &str = "x-deferral-count";

/// Header a quorum queue sets on a redelivery: how many earlier deliveries
/// of the message were not acked ([`Event::delivery_count`]).
pub const HEADER_DELIVERY_COUNT: &str = "x-delivery-count";

/// One received event, decoded from its AMQP message ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md)).
#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) id: String,
    pub(crate) properties: BasicProperties,
    pub(crate) payload: Vec<u8>,
    pub(crate) redelivered: bool,
}

impl Event {
    /// The dedup key: the event id by default (see [`DedupKey`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The AMQP `message_id`, if any.
    pub fn message_id(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|s| s.as_str())
    }

    /// The event type (AMQP `type`).
    pub fn event_type(&self) -> Option<&str> {
        self.properties.kind().as_ref().map(|s| s.as_str())
    }

    /// The aggregate type (header `x-aggregate-type`).
    pub fn aggregate_type(&self) -> Option<Cow<'_, str>> {
        self.header_str(wire::HEADER_AGGREGATE_TYPE)
    }

    /// The aggregate id (header `x-aggregate-id`).
    pub fn aggregate_id(&self) -> Option<Cow<'_, str>> {
        self.header_str(wire::HEADER_AGGREGATE_ID)
    }

    /// The event's position in its aggregate (header `x-aggregate-seq`):
    /// `Some` for ordered events. See
    /// [`Sequencing`](crate::Sequencing) for what the consumer does with it.
    pub fn aggregate_seq(&self) -> Option<i64> {
        match self.header(wire::HEADER_AGGREGATE_SEQ)? {
            AMQPValue::Timestamp(_) => None,
            v => amqp_int(v),
        }
    }

    /// The W3C `traceparent` header, if the producer sent one.
    pub fn traceparent(&self) -> Option<Cow<'_, str>> {
        self.header_str(wire::HEADER_TRACEPARENT)
    }

    /// A child of the producer's trace context (from `traceparent`): the
    /// consumer's span continues the producer's trace. `None` without a
    /// valid `traceparent`.
    pub fn trace(&self) -> Option<crate::TraceContext> {
        crate::TraceContext::child_of(&self.traceparent()?)
    }

    /// All AMQP headers.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    /// One header's raw value.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// One header as text: strings as they are, numbers and booleans
    /// formatted; `None` when absent or of another type.
    pub fn header_str(&self, name: &str) -> Option<Cow<'_, str>> {
        amqp_text(self.header(name)?)
    }

    /// How many times a handler asked to retry this event so far
    /// (header `x-retry-count`; 0 on first delivery). Deferrals of an
    /// ordered consumer are not counted here (see
    /// [`deferral_count`](Self::deferral_count)).
    pub fn retry_count(&self) -> u32 {
        self.count(wire::HEADER_RETRY_COUNT)
    }

    /// How many times an ordered consumer deferred this event so far
    /// (header [`x-deferral-count`](HEADER_DEFERRAL_COUNT); 0 when never
    /// deferred).
    pub fn deferral_count(&self) -> u32 {
        self.count(HEADER_DEFERRAL_COUNT)
    }

    /// How many times a quorum queue delivered this message before this
    /// delivery without it being acked (header `x-delivery-count`, set by
    /// the broker: a consumer crashed or lost its connection holding it).
    /// 0 on a first delivery and on classic queues. The work queue's
    /// delivery limit ([`TopologyConfig::delivery_limit`](crate::TopologyConfig::delivery_limit))
    /// moves the message to the dead-letter queue past it.
    pub fn delivery_count(&self) -> u32 {
        self.count(HEADER_DELIVERY_COUNT)
    }

    fn count(&self, header: &str) -> u32 {
        self.header(header)
            .and_then(amqp_int)
            .map_or(0, |n| u32::try_from(n).unwrap_or(0))
    }

    /// Whether the broker flagged this delivery as a redelivery (it was
    /// delivered before and not acked, e.g. the previous consumer died).
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The AMQP properties as received.
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The body: the payload's JSON text.
    pub fn payload_bytes(&self) -> &[u8] {
        &self.payload
    }

    /// The payload decoded into `T`.
    pub fn payload<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.payload)
    }
}

/// The dedup key of a delivery; `Err` holds why the delivery is poison (the
/// reason recorded on its dead-lettered copy).
pub(crate) fn dedup_key(
    props: &BasicProperties,
    payload: &[u8],
    key: &DedupKey,
) -> Result<String, String> {
    let not_json = |e: serde_json::Error| format!("body is not valid JSON: {e}");
    // Only a payload-field key needs the parsed document; otherwise just
    // check the body is JSON, without building it.
    let json: Option<Value> = match key {
        DedupKey::PayloadField(_) => Some(serde_json::from_slice(payload).map_err(not_json)?),
        _ => {
            serde_json::from_slice::<serde::de::IgnoredAny>(payload).map_err(not_json)?;
            None
        }
    };
    let id = match key {
        DedupKey::MessageId => props
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .ok_or("message has no message_id (the dedup key)")?,
        DedupKey::Header(h) => props
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get(h.as_str()))
            .and_then(amqp_text)
            .map(Cow::into_owned)
            .ok_or_else(|| format!("message has no text header {h:?} (the dedup key)"))?,
        DedupKey::PayloadField(p) => match json.as_ref().and_then(|j| j.pointer(p)) {
            Some(Value::String(s)) => s.clone(),
            Some(v @ (Value::Number(_) | Value::Bool(_))) => v.to_string(),
            _ => {
                return Err(format!(
                    "payload has no scalar field at {p:?} (the dedup key)"
                ));
            }
        },
    };
    if id.is_empty() {
        return Err("the dedup key is empty".to_owned());
    }
    // PostgreSQL refuses NUL in text, and a B-tree entry must fit a page:
    // such keys could never be recorded, so the batch would never commit.
    if id.contains('\0') {
        return Err("the dedup key contains a NUL character".to_owned());
    }
    if id.len() > MAX_DEDUP_KEY_BYTES {
        return Err(format!(
            "the dedup key is {} bytes, over the limit of {MAX_DEDUP_KEY_BYTES}",
            id.len()
        ));
    }
    Ok(id)
}

/// Longest dedup key accepted; longer keys are poison (dead-lettered).
pub const MAX_DEDUP_KEY_BYTES: usize = 512;

pub(crate) fn amqp_text(v: &AMQPValue) -> Option<Cow<'_, str>> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(Cow::Borrowed(s.as_str())),
        AMQPValue::Boolean(b) => Some(Cow::Owned(b.to_string())),
        other => amqp_int(other).map(|n| Cow::Owned(n.to_string())),
    }
}

pub(crate) fn amqp_int(v: &AMQPValue) -> Option<i64> {
    Some(match *v {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => i64::try_from(n).ok()?,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props() -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert("x-key".into(), AMQPValue::LongString("k-1".into()));
        h.insert(wire::HEADER_RETRY_COUNT.into(), AMQPValue::LongInt(2));
        h.insert(HEADER_DEFERRAL_COUNT.into(), AMQPValue::LongLongInt(7));
        h.insert(
            wire::HEADER_AGGREGATE_ID.into(),
            AMQPValue::LongString("o-1".into()),
        );
        BasicProperties::default()
            .with_message_id("m-1".into())
            .with_type("OrderPlaced".into())
            .with_headers(h)
    }

    #[test]
    fn keys_come_from_the_configured_source() {
        let body = br#"{"order_id": 42, "sku": "A"}"#.to_vec();
        let decode = |key: DedupKey| {
            let id = dedup_key(&props(), &body, &key)?;
            Ok::<_, String>(Event {
                id,
                properties: props(),
                payload: body.clone(),
                redelivered: false,
            })
        };
        let e = decode(DedupKey::MessageId).unwrap();
        assert_eq!(e.id(), "m-1");
        assert_eq!(e.retry_count(), 2);
        assert_eq!(e.deferral_count(), 7);
        assert_eq!(e.aggregate_id().as_deref(), Some("o-1"));
        assert_eq!(e.event_type(), Some("OrderPlaced"));
        let e = decode(DedupKey::Header("x-key".into())).unwrap();
        assert_eq!(e.id(), "k-1");
        let e = decode(DedupKey::PayloadField("/order_id".into())).unwrap();
        assert_eq!(e.id(), "42");
        let v: Value = e.payload().unwrap();
        assert_eq!(v["sku"], "A");
    }

    #[test]
    fn poison_is_explained() {
        let no_id = dedup_key(&BasicProperties::default(), b"{}", &DedupKey::MessageId);
        assert!(no_id.unwrap_err().contains("no message_id"));
        let bad = dedup_key(&props(), b"not json", &DedupKey::MessageId);
        assert!(bad.unwrap_err().contains("not valid JSON"));
        let missing = dedup_key(&props(), b"{}", &DedupKey::PayloadField("/x".into()));
        assert!(missing.unwrap_err().contains("/x"));
        // Keys the inbox could never store are poison, not an endless retry.
        let nul = BasicProperties::default().with_message_id("a\0b".into());
        assert!(
            dedup_key(&nul, b"{}", &DedupKey::MessageId)
                .unwrap_err()
                .contains("NUL")
        );
        let long = format!("{{\"k\": \"{}\"}}", "x".repeat(MAX_DEDUP_KEY_BYTES + 1));
        let err = dedup_key(
            &props(),
            long.as_bytes(),
            &DedupKey::PayloadField("/k".into()),
        )
        .unwrap_err();
        assert!(err.contains("over the limit"), "{err}");
    }

    /// Whatever arrives, decoding never panics: an arbitrary body, message
    /// id, type and headers (text, bytes, numbers of every width, nested
    /// tables and arrays, under the names the consumer reads) give a key or
    /// a poison reason, and every accessor answers.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn value() -> impl Strategy<Value = AMQPValue> {
            let leaf = prop_oneof![
                any::<String>().prop_map(|s| AMQPValue::LongString(s.into())),
                proptest::collection::vec(any::<u8>(), 0..40)
                    .prop_map(|b| AMQPValue::LongString(b.into())),
                "[a-z0-9-]{0,20}".prop_map(|s| AMQPValue::ShortString(s.into())),
                any::<bool>().prop_map(AMQPValue::Boolean),
                any::<i8>().prop_map(AMQPValue::ShortShortInt),
                any::<u8>().prop_map(AMQPValue::ShortShortUInt),
                any::<i16>().prop_map(AMQPValue::ShortInt),
                any::<u16>().prop_map(AMQPValue::ShortUInt),
                any::<i32>().prop_map(AMQPValue::LongInt),
                any::<u32>().prop_map(AMQPValue::LongUInt),
                any::<i64>().prop_map(AMQPValue::LongLongInt),
                any::<f32>().prop_map(AMQPValue::Float),
                any::<f64>().prop_map(AMQPValue::Double),
                any::<u64>().prop_map(AMQPValue::Timestamp),
                Just(AMQPValue::Void),
            ];
            leaf.prop_recursive(3, 16, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4)
                        .prop_map(|v| AMQPValue::FieldArray(v.into())),
                    proptest::collection::vec(("[a-z-]{1,12}", inner), 0..4).prop_map(|kv| {
                        let mut t = FieldTable::default();
                        for (k, v) in kv {
                            t.insert(k.into(), v);
                        }
                        AMQPValue::FieldTable(t)
                    }),
                ]
            })
        }

        fn header_name() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(wire::HEADER_AGGREGATE_ID.to_owned()),
                Just(wire::HEADER_AGGREGATE_TYPE.to_owned()),
                Just(wire::HEADER_AGGREGATE_SEQ.to_owned()),
                Just(wire::HEADER_RETRY_COUNT.to_owned()),
                Just(HEADER_DEFERRAL_COUNT.to_owned()),
                Just("traceparent".to_owned()),
                Just("tracestate".to_owned()),
                Just("x-key".to_owned()),
                "[a-z-]{1,12}",
            ]
        }

        fn body() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                any::<String>().prop_map(String::into_bytes),
                (any::<String>(), any::<i64>()).prop_map(|(s, n)| {
                    serde_json::json!({"k": s, "n": n, "nested": {"k": [s, n]}})
                        .to_string()
                        .into_bytes()
                }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]
            #[test]
            fn decoding_never_panics(
                id in proptest::option::of(any::<String>()),
                kind in proptest::option::of(any::<String>()),
                headers in proptest::collection::vec((header_name(), value()), 0..8),
                payload in body(),
                key in prop_oneof![
                    Just(DedupKey::MessageId),
                    Just(DedupKey::Header("x-key".into())),
                    Just(DedupKey::PayloadField("/k".into())),
                    Just(DedupKey::PayloadField("/nested/k/1".into())),
                ],
            ) {
                let mut t = FieldTable::default();
                for (k, v) in headers {
                    t.insert(k.into(), v);
                }
                let mut properties = BasicProperties::default().with_headers(t);
                if let Some(id) = id {
                    properties = properties.with_message_id(id.into());
                }
                if let Some(kind) = kind {
                    properties = properties.with_type(kind.into());
                }
                let _ = crate::sequence::position(&properties);
                if let Ok(id) = dedup_key(&properties, &payload, &key) {
                    prop_assert!(!id.is_empty() && id.len() <= MAX_DEDUP_KEY_BYTES);
                    let e = Event { id, properties, payload, redelivered: true };
                    let _ = (e.aggregate_type(), e.aggregate_id(), e.aggregate_seq());
                    let _ = (e.retry_count(), e.deferral_count(), e.event_type());
                    let _ = (e.traceparent(), e.trace(), e.header_str("x-key"));
                    let _ = e.payload::<Value>();
                }
            }
        }
    }
}
