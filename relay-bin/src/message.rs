//! Turning an outbox row into the AMQP message of the contract
//! (`docs/AMQP_MESSAGE.md`, constants in `outbox::wire`).

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use outbox::wire;
use serde_json::Value;
use uuid::Uuid;

/// An event claimed from the outbox, as the relay publishes it.
#[derive(Debug, Clone, sqlx::FromRow)]
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

impl ClaimedEvent {
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

    /// Why this event cannot go on the wire as it is: AMQP short strings
    /// (exchange, routing key, `type`, header names) hold at most 255 bytes.
    pub fn short_string_problem(&self, exchange: &str) -> Option<String> {
        let too_long = |what: &str, v: &str| {
            (v.len() > 255).then(|| format!("{what} is {} bytes; AMQP allows at most 255", v.len()))
        };
        too_long("event type", &self.event_type)
            .or_else(|| too_long("exchange", exchange))
            .or_else(|| too_long("routing key", &self.routing_key()))
            .or_else(|| {
                let headers: serde_json::Map<String, Value> =
                    serde_json::from_str(&self.headers).ok()?;
                headers.keys().find_map(|k| too_long("a header name", k))
            })
    }

    /// The AMQP properties of the contract.
    pub fn properties(&self) -> BasicProperties {
        let mut headers = FieldTable::default();
        // The event's own headers first, so the contract's aggregate headers
        // cannot be overridden by accident.
        if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(&self.headers) {
            // An event's own header of the sequence's name must not pass
            // for a sequence number.
            for (k, v) in map
                .into_iter()
                .filter(|(k, _)| k != wire::HEADER_AGGREGATE_SEQ)
            {
                headers.insert(ShortString::from(k), json_to_amqp(v));
            }
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
        BasicProperties::default()
            .with_message_id(self.id.to_string().into())
            .with_type(self.event_type.as_str().into())
            .with_content_type(wire::CONTENT_TYPE.into())
            .with_delivery_mode(wire::DELIVERY_MODE_PERSISTENT)
            .with_timestamp(self.created_at.timestamp().max(0) as u64)
            .with_app_id("outbox-relay".into())
            .with_headers(headers)
    }
}

/// JSON header values map to the nearest AMQP field type; arrays and
/// objects travel as their JSON text.
fn json_to_amqp(v: Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => AMQPValue::LongString(n.to_string().into()),
        },
        Value::String(s) => AMQPValue::LongString(s.into()),
        other @ (Value::Array(_) | Value::Object(_)) => {
            AMQPValue::LongString(other.to_string().into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let e =
            event(r#"{"traceparent":"00-abc-def-01","n":3,"ok":true,"x-aggregate-id":"spoof"}"#);
        let p = e.properties();
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
        assert_eq!(h["x-aggregate-type"], AMQPValue::LongString("order".into()));
        assert_eq!(h["x-aggregate-id"], AMQPValue::LongString("o-1".into()));
        assert!(!h.contains_key("x-aggregate-seq"), "unordered: no sequence");
        let mut ordered = event(r#"{"x-aggregate-seq": 99}"#);
        ordered.aggregate_seq = Some(7);
        let p = ordered.properties();
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(h["x-aggregate-seq"], AMQPValue::LongLongInt(7));
        assert_eq!(e.routing_key(), "order.OrderPlaced");
        assert_eq!(e.exchange_or("outbox.events"), "outbox.events");
        assert_eq!(e.short_string_problem("outbox.events"), None);
    }

    #[test]
    fn names_over_255_bytes_cannot_be_published() {
        let long = "x".repeat(256);
        let mut e = event("{}");
        e.event_type = long.clone();
        assert!(e.short_string_problem("x").unwrap().contains("event type"));
        let mut e = event("{}");
        e.routing_key = Some(long.clone());
        assert!(e.short_string_problem("x").unwrap().contains("routing key"));
        assert!(
            event("{}")
                .short_string_problem(&long)
                .unwrap()
                .contains("exchange")
        );
        let e = event(&format!("{{\"{long}\": 1}}"));
        assert!(e.short_string_problem("x").unwrap().contains("header name"));
    }
}
