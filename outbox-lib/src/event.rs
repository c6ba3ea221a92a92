use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Namespace of deterministic event ids ([`NewEvent::id_from_key`],
/// [`NewEvent::derive_id`]).
pub const EVENT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6a0f_57d1_3c2e_4b8e_9d1a_0c5e_8b7f_4e21);

/// An event to write to the outbox, built before the transaction commits.
///
/// ```
/// use outbox::NewEvent;
/// # fn main() -> Result<(), outbox::Error> {
/// #[derive(serde::Serialize)]
/// struct OrderPlaced { sku: String, quantity: u32 }
///
/// let event = NewEvent::new("order", "o-42", "OrderPlaced", &OrderPlaced { sku: "A-1".into(), quantity: 2 })?
///     .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
///     .routing_key("orders.placed")
///     .id_from_key("checkout-7f3a");
/// assert_eq!(event.id(), NewEvent::derive_id("OrderPlaced", "checkout-7f3a"));
/// # Ok(()) }
/// ```
///
/// Defaults: the id is a fresh UUIDv7 (time-ordered); `exchange` and
/// `routing_key` are left unset so the relay applies its own defaults (its
/// configured exchange, and `<aggregate_type>.<event_type>`).
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub(crate) id: Uuid,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: String,
    pub(crate) event_type: String,
    pub(crate) payload: String,
    pub(crate) headers: Map<String, Value>,
    pub(crate) exchange: Option<String>,
    pub(crate) routing_key: Option<String>,
}

impl NewEvent {
    /// An event about aggregate `aggregate_type`/`aggregate_id` with a
    /// payload that serialises to JSON. Fails only if serialisation fails;
    /// field validation happens at enqueue time.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &impl Serialize,
    ) -> Result<Self> {
        let payload = serde_json::to_string(payload).map_err(Error::Serialize)?;
        Ok(Self::build(
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
        ))
    }

    /// Like [`NewEvent::new`] with a payload that is already JSON text;
    /// fails with [`Error::InvalidJson`] if it is not.
    pub fn from_json(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload_json: impl Into<String>,
    ) -> Result<Self> {
        let payload = payload_json.into();
        serde_json::from_str::<serde::de::IgnoredAny>(&payload).map_err(Error::InvalidJson)?;
        Ok(Self::build(
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
        ))
    }

    fn build(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: String,
    ) -> Self {
        Self {
            id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Map::new(),
            exchange: None,
            routing_key: None,
        }
    }

    /// The event id that will be written.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Uses an explicit event id.
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    /// Derives the event id from a natural key (an idempotency key, an
    /// external reference), so re-running the same logical operation yields
    /// the same id and cannot create a second event. See
    /// [`NewEvent::derive_id`].
    pub fn id_from_key(mut self, natural_key: &str) -> Self {
        self.id = Self::derive_id(&self.event_type, natural_key);
        self
    }

    /// The deterministic id [`NewEvent::id_from_key`] uses: UUIDv5 over
    /// [`EVENT_ID_NAMESPACE`] and `"<len(event_type)>:<event_type>:<natural_key>"`
    /// (the length prefix keeps the split unambiguous). The event type is
    /// part of it so one operation can emit several event types.
    pub fn derive_id(event_type: &str, natural_key: &str) -> Uuid {
        let name = format!("{}:{event_type}:{natural_key}", event_type.len());
        Uuid::new_v5(&EVENT_ID_NAMESPACE, name.as_bytes())
    }

    /// Adds one header (an AMQP header on the published message). A W3C
    /// `traceparent` passes through untouched.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Replaces all headers; `headers` must serialise to a JSON object.
    pub fn headers(mut self, headers: &impl Serialize) -> Result<Self> {
        match serde_json::to_value(headers).map_err(Error::Serialize)? {
            Value::Object(map) => {
                self.headers = map;
                Ok(self)
            }
            other => Err(Error::HeadersNotObject {
                found: json_type(&other),
            }),
        }
    }

    /// Publishes to this exchange instead of the relay's default.
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = Some(exchange.into());
        self
    }

    /// Publishes with this routing key instead of
    /// `<aggregate_type>.<event_type>`.
    pub fn routing_key(mut self, routing_key: impl Into<String>) -> Self {
        self.routing_key = Some(routing_key.into());
        self
    }

    /// Checks the event against the rules the outbox table and the relay
    /// rely on.
    pub(crate) fn validate(&self, max_payload_bytes: usize) -> Result<()> {
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
        ] {
            if value.trim().is_empty() {
                return Err(Error::EmptyField { field });
            }
        }
        let default_key;
        let routing_key = match &self.routing_key {
            Some(k) => k.as_str(),
            None => {
                default_key =
                    crate::wire::default_routing_key(&self.aggregate_type, &self.event_type);
                default_key.as_str()
            }
        };
        let names = [
            ("event_type", self.event_type.as_str()),
            ("exchange", self.exchange.as_deref().unwrap_or("")),
            ("routing_key", routing_key),
        ];
        let header_names = self.headers.keys().map(|k| ("a header name", k.as_str()));
        for (field, name) in names.into_iter().chain(header_names) {
            if name.len() > 255 {
                return Err(Error::NameTooLong {
                    field,
                    len: name.len(),
                });
            }
        }
        if self.payload.len() > max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                size: self.payload.len(),
                limit: max_payload_bytes,
            });
        }
        Ok(())
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ids_are_v7_and_time_ordered() {
        let a = NewEvent::from_json("a", "1", "E", "{}").unwrap();
        let b = NewEvent::from_json("a", "1", "E", "{}").unwrap();
        assert_eq!(a.id().get_version_num(), 7);
        assert!(a.id() < b.id());
    }

    #[test]
    fn derived_ids_are_stable_and_depend_on_type_and_key() {
        let a = NewEvent::from_json("a", "1", "E", "{}")
            .unwrap()
            .id_from_key("k");
        assert_eq!(a.id(), NewEvent::derive_id("E", "k"));
        assert_ne!(a.id(), NewEvent::derive_id("F", "k"));
        assert_ne!(a.id(), NewEvent::derive_id("E", "k2"));
        // No ambiguity in where the type ends and the key starts.
        assert_ne!(
            NewEvent::derive_id("E:", "k"),
            NewEvent::derive_id("E", ":k")
        );
        // Stable across releases: other languages can derive the same id.
        assert_eq!(
            NewEvent::derive_id("OrderPlaced", "k-1").to_string(),
            uuid::Uuid::new_v5(&EVENT_ID_NAMESPACE, b"11:OrderPlaced:k-1").to_string()
        );
        assert_eq!(a.id().get_version_num(), 5);
    }

    #[test]
    fn from_json_rejects_invalid_json() {
        assert!(matches!(
            NewEvent::from_json("a", "1", "E", "{not json"),
            Err(Error::InvalidJson(_))
        ));
    }

    #[test]
    fn headers_must_be_an_object() {
        let e = NewEvent::from_json("a", "1", "E", "{}").unwrap();
        assert!(matches!(
            e.clone().headers(&vec![1, 2]),
            Err(Error::HeadersNotObject { found: "an array" })
        ));
        assert!(matches!(
            e.clone().headers(&"x"),
            Err(Error::HeadersNotObject { found: "a string" })
        ));
        let ok = e.headers(&serde_json::json!({"traceparent": "t"})).unwrap();
        assert_eq!(ok.headers["traceparent"], "t");
    }

    #[test]
    fn validation_rejects_empty_fields() {
        let e = NewEvent::from_json(" ", "1", "E", "{}").unwrap();
        assert!(matches!(
            e.validate(10),
            Err(Error::EmptyField {
                field: "aggregate_type"
            })
        ));
        let e = NewEvent::from_json("a", "", "E", "{}").unwrap();
        assert!(matches!(
            e.validate(10),
            Err(Error::EmptyField {
                field: "aggregate_id"
            })
        ));
        let e = NewEvent::from_json("a", "1", "", "{}").unwrap();
        assert!(matches!(
            e.validate(10),
            Err(Error::EmptyField {
                field: "event_type"
            })
        ));
    }

    #[test]
    fn validation_rejects_names_too_long() {
        let long = "x".repeat(256);
        let e = NewEvent::from_json("a", "1", &long, "{}").unwrap();
        assert!(matches!(
            e.validate(10),
            Err(Error::NameTooLong {
                field: "event_type",
                len: 256
            })
        ));
        let e = NewEvent::from_json("a", "1", "E", "{}")
            .unwrap()
            .routing_key(&long);
        assert!(matches!(
            e.validate(10),
            Err(Error::NameTooLong {
                field: "routing_key",
                ..
            })
        ));
        let e = NewEvent::from_json(&long[..250], "1", "Event", "{}").unwrap();
        assert!(
            matches!(
                e.validate(10),
                Err(Error::NameTooLong {
                    field: "routing_key",
                    ..
                })
            ),
            "the derived key counts"
        );
        let e = NewEvent::from_json("a", "1", "E", "{}")
            .unwrap()
            .header(long.clone(), 1);
        assert!(matches!(
            e.validate(10),
            Err(Error::NameTooLong {
                field: "a header name",
                ..
            })
        ));
    }

    #[test]
    fn validation_rejects_big_payloads() {
        let e = NewEvent::from_json("a", "1", "E", "\"0123456789\"").unwrap();
        assert!(matches!(
            e.validate(10),
            Err(Error::PayloadTooLarge {
                size: 12,
                limit: 10
            })
        ));
        assert!(e.validate(12).is_ok());
    }
}
