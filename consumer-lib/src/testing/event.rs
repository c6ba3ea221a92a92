//! Built events: what the relay would publish, without a relay.

use lapin::types::{AMQPValue, FieldTable};
use outbox::testing::Enqueued;
use outbox::wire;
use outbox_core::amqp::{Envelope, event_properties, json_header_value};
use serde::Serialize;
use serde_json::Value;

use crate::event::{Event, HEADER_DEFERRAL_COUNT};

/// Builds an [`Event`] as the relay publishes it
/// ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md)):
/// the event id as `message_id`, the event type as `type`, the aggregate
/// headers, the payload as the JSON body, the event's own headers.
///
/// Defaults: a fresh UUIDv7 id, aggregate `test` / `1`, payload `{}`, no
/// sequence number, first delivery (no retry or deferral count, not
/// redelivered).
///
/// ```
/// use outbox_consumer::testing::EventBuilder;
///
/// let event = EventBuilder::new("captured")
///     .aggregate("payment", "p-1")
///     .payload(&serde_json::json!({"account": "acme", "cents": 500}))
///     .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
///     .build();
/// assert_eq!(event.event_type(), Some("captured"));
/// assert_eq!(event.aggregate_id().as_deref(), Some("p-1"));
/// assert_eq!(event.payload::<serde_json::Value>().unwrap()["cents"], 500);
/// assert_eq!(event.retry_count(), 0);
/// ```
#[derive(Debug, Clone)]
pub struct EventBuilder {
    id: String,
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    sequence: Option<i64>,
    payload: Vec<u8>,
    headers: FieldTable,
    redelivered: bool,
}

impl EventBuilder {
    /// An event of type `event_type`, with the defaults above.
    pub fn new(event_type: impl Into<String>) -> Self {
        Self {
            id: uuid::Uuid::now_v7().to_string(),
            event_type: event_type.into(),
            aggregate_type: "test".to_owned(),
            aggregate_id: "1".to_owned(),
            sequence: None,
            payload: b"{}".to_vec(),
            headers: FieldTable::default(),
            redelivered: false,
        }
    }

    /// The event id (`message_id`, the default dedup key). Two events
    /// with one id are copies of one event: the second is a duplicate.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// The aggregate (headers `x-aggregate-type`, `x-aggregate-id`).
    pub fn aggregate(mut self, aggregate_type: impl Into<String>, id: impl Into<String>) -> Self {
        self.aggregate_type = aggregate_type.into();
        self.aggregate_id = id.into();
        self
    }

    /// The event's number in its aggregate (header `x-aggregate-seq`), as
    /// the relay publishes an ordered aggregate's events: 1, 2, 3, ...
    /// A consumer with [`Sequencing`](crate::Sequencing) on applies them
    /// in that order.
    pub fn sequence(mut self, seq: i64) -> Self {
        self.sequence = Some(seq);
        self
    }

    /// The payload, serialised to JSON.
    ///
    /// # Panics
    ///
    /// When `payload` cannot be serialised (a map with non-string keys):
    /// a test's mistake.
    pub fn payload(mut self, payload: &impl Serialize) -> Self {
        self.payload = serde_json::to_vec(payload).expect("the test's payload serialises to JSON");
        self
    }

    /// The body as it is, JSON or not (a body that is not JSON is poison:
    /// dead-lettered).
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.payload = body.into();
        self
    }

    /// One header of the event's own, converted as the relay converts
    /// the outbox's `headers`: strings to long strings, integers to 64-bit
    /// integers, other numbers to doubles, booleans, null to void, arrays
    /// and objects to their compact JSON text. The aggregate headers win
    /// over same-named ones, and `x-aggregate-seq` comes from
    /// [`sequence`](Self::sequence) only, as on the wire.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(
            name.into().into(),
            json_header_value(&value.into().to_string()),
        );
        self
    }

    /// As the copy the consumer republishes after its handler asked for
    /// `n` retries (header `x-retry-count`): past
    /// [`max_retries`](crate::ConsumerConfig::max_retries) the next retry
    /// dead-letters it.
    pub fn retry_count(mut self, n: u32) -> Self {
        self.headers.insert(
            wire::HEADER_RETRY_COUNT.into(),
            AMQPValue::LongLongInt(n.into()),
        );
        self
    }

    /// As the copy an ordered consumer republishes after deferring it `n`
    /// times (header `x-deferral-count`).
    pub fn deferral_count(mut self, n: u32) -> Self {
        self.headers.insert(
            HEADER_DEFERRAL_COUNT.into(),
            AMQPValue::LongLongInt(n.into()),
        );
        self
    }

    /// Flags the delivery as a redelivery (the broker's `redelivered`).
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }

    /// The event.
    pub fn build(self) -> Event {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let envelope = Envelope {
            message_id: self.id.as_str().into(),
            event_type: self.event_type.as_str().into(),
            aggregate_type: &self.aggregate_type,
            aggregate_id: &self.aggregate_id,
            aggregate_seq: self.sequence,
            timestamp: now,
        };
        let own = self
            .headers
            .inner()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()));
        let properties = event_properties(envelope, own);
        Event {
            id: self.id,
            properties,
            payload: self.payload,
            redelivered: self.redelivered,
        }
    }
}

/// The event as the relay would publish what the producer enqueued
/// ([`outbox::testing::enqueued`]): its id, type, aggregate, sequence
/// number, payload and headers.
impl From<&Enqueued> for EventBuilder {
    fn from(e: &Enqueued) -> Self {
        let mut b = EventBuilder::new(e.event_type.as_str())
            .id(e.id.to_string())
            .aggregate(e.aggregate_type.as_str(), e.aggregate_id.as_str())
            .payload(&e.payload);
        for (name, value) in &e.headers {
            b = b.header(name.as_str(), value.clone());
        }
        b.sequence = e.aggregate_seq;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_events_carry_the_contracts_fields() {
        let e = EventBuilder::new("captured")
            .id("e-1")
            .aggregate("payment", "p-1")
            .sequence(3)
            .header("n", 7)
            .header("f", 1.5)
            .header("o", serde_json::json!({"a": [1, "x y"]}))
            .header(wire::HEADER_AGGREGATE_ID, "spoof")
            .header(wire::HEADER_AGGREGATE_SEQ, 99)
            .retry_count(2)
            .deferral_count(4)
            .redelivered(true)
            .build();
        assert_eq!(e.id(), "e-1");
        assert_eq!(e.message_id(), Some("e-1"));
        assert_eq!(e.event_type(), Some("captured"));
        assert_eq!(e.aggregate_type().as_deref(), Some("payment"));
        assert_eq!(e.aggregate_id().as_deref(), Some("p-1"));
        assert_eq!(e.aggregate_seq(), Some(3));
        assert_eq!(e.header("n"), Some(&AMQPValue::LongLongInt(7)));
        assert_eq!(e.header("f"), Some(&AMQPValue::Double(1.5)));
        assert_eq!(e.header_str("o").as_deref(), Some(r#"{"a":[1,"x y"]}"#));
        assert_eq!((e.retry_count(), e.deferral_count()), (2, 4));
        assert!(e.redelivered());
        assert_eq!(e.payload_bytes(), b"{}");
        let p = e.properties();
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            wire::CONTENT_TYPE
        );
        assert_eq!(*p.delivery_mode(), Some(wire::DELIVERY_MODE_PERSISTENT));
    }
}
