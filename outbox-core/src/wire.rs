//! The AMQP message contract shared by the relay and the consumer. See
//! [`docs/AMQP_MESSAGE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/AMQP_MESSAGE.md).
//!
//! One published event is one AMQP message:
//!
//! | AMQP field | value |
//! |---|---|
//! | `message_id` | the event id (UUID, hyphenated lower case) |
//! | `type` | the event type |
//! | `content_type` | [`CONTENT_TYPE`] |
//! | `delivery_mode` | 2 (persistent) |
//! | `timestamp` | the event's `created_at`, Unix seconds |
//! | header [`HEADER_AGGREGATE_TYPE`] | the aggregate type |
//! | header [`HEADER_AGGREGATE_ID`] | the aggregate id |
//! | header [`HEADER_AGGREGATE_SEQ`] | ordered events only: the event's position in its aggregate (1, 2, 3, ...) |
//! | other headers | the event's own headers, as given (`traceparent` untouched) |
//! | body | the payload, JSON |

/// Content type of every published event body.
pub const CONTENT_TYPE: &str = "application/json";
/// AMQP header carrying the aggregate type.
pub const HEADER_AGGREGATE_TYPE: &str = "x-aggregate-type";
/// AMQP header carrying the aggregate id.
pub const HEADER_AGGREGATE_ID: &str = "x-aggregate-id";
/// AMQP header (long-long integer) carrying an ordered event's sequence
/// number within its aggregate: 1 for the aggregate's first ordered event,
/// then +1 per event in commit order, without gaps except where an event
/// was skipped by an operator (or dead-lettered). Absent on unordered events.
pub const HEADER_AGGREGATE_SEQ: &str = "x-aggregate-seq";
/// W3C trace context header; passed through untouched.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// Header the consumer sets on a dead-lettered message: why it was rejected.
pub const HEADER_DEAD_LETTER_REASON: &str = "x-dead-letter-reason";
/// Header the consumer sets on a retried message: how many times the handler
/// asked for a retry so far.
pub const HEADER_RETRY_COUNT: &str = "x-retry-count";
/// AMQP delivery mode for persistent messages.
pub const DELIVERY_MODE_PERSISTENT: u8 = 2;

/// Default routing key the relay derives when an event has none:
/// `<aggregate_type>.<event_type>`.
pub fn default_routing_key(aggregate_type: &str, event_type: &str) -> String {
    format!("{aggregate_type}.{event_type}")
}
