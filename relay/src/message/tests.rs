use super::*;
use serde_json::Value;

const FRAME: usize = 131_072;

fn event(headers: &str) -> OutboxEvent {
    OutboxEvent {
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

/// RabbitMQ closes the channel on a `CC` or `BCC` header that is not an
/// array (and routes by one that is): such an event is refused, never
/// published; other cases of the names are plain headers.
#[test]
fn rabbitmqs_routing_headers_cannot_be_published() {
    for name in ["CC", "BCC"] {
        for value in ["\"q\"", "[\"q\"]", "1"] {
            let err = event(&format!("{{\"{name}\": {value}}}"))
                .to_message("x", FRAME)
                .unwrap_err();
            assert!(err.contains("sender-selected distribution"), "{err}");
        }
    }
    for name in ["cc", "Bcc", "CCC", "x-CC"] {
        assert!(
            event(&format!("{{\"{name}\": \"q\"}}"))
                .to_message("x", FRAME)
                .is_ok(),
            "{name}"
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
