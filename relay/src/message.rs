//! Turning an outbox row into the AMQP message of the contract
//! ([`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md), constants in `outbox::wire`).

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use outbox::wire;
use outbox_core::amqp::{Envelope, event_properties, json_header_value};
use serde_json::value::RawValue;
use uuid::Uuid;

/// An event as the relay publishes it: a row claimed from the outbox
/// table, or a message read from the write-ahead log.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxEvent {
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
/// stays private: [`OutboxEvent`] does not promise sqlx's `FromRow`).
#[derive(sqlx::FromRow)]
pub(crate) struct EventRow {
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

impl From<EventRow> for OutboxEvent {
    fn from(r: EventRow) -> Self {
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

impl OutboxEvent {
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
        // Values are kept as raw JSON text: nesting of any depth converts
        // without recursion.
        let raw: std::collections::BTreeMap<String, Box<RawValue>> =
            serde_json::from_str(&self.headers)
                .map_err(|e| format!("headers are not a JSON object: {e}"))?;
        let mut own = Vec::with_capacity(raw.len());
        for (k, v) in raw {
            // RabbitMQ's sender-selected distribution: these route the
            // message to more queues, and must be arrays, which no JSON
            // value becomes here; as anything else the broker closes the
            // channel, failing every message in flight on it.
            if RABBITMQ_ROUTING_HEADERS.contains(&k.as_str()) {
                return Err(format!(
                    "a header named {k:?} is RabbitMQ's sender-selected distribution \
                     (extra routing keys): rename it"
                ));
            }
            own.push((short("a header name", k)?, json_header_value(v.get())));
        }
        let envelope = Envelope {
            message_id: self.id.to_string().into(),
            event_type: short("event type", self.event_type.clone())?,
            aggregate_type: &self.aggregate_type,
            aggregate_id: &self.aggregate_id,
            aggregate_seq: self.aggregate_seq,
            timestamp: self.created_at.timestamp().max(0) as u64,
        };
        Ok(event_properties(envelope, own))
    }

    /// The whole message, or why it can never be published as it is (see
    /// [`OutboxEvent::properties`]; also an exchange or routing key over
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

/// Header names RabbitMQ reads as extra routing keys (`CC`, `BCC`;
/// case-sensitive).
const RABBITMQ_ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

fn short(what: &str, v: String) -> Result<ShortString, String> {
    let len = v.len();
    ShortString::try_new(v).map_err(|_| format!("{what} is {len} bytes; AMQP allows at most 255"))
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

/// Type tag plus value, for the types [`json_header_value`] produces (others
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
mod tests;
