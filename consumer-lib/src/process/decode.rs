//! The decode stage: an event, with its span, per decodable delivery;
//! poison stays in its delivery for the dead-letter copy.

use lapin::BasicProperties;
use lapin::message::Delivery;
use tracing::Span;
use tracing::field::Empty;

use crate::config::ConsumerConfig;
use crate::event::{Event, dedup_key};
use crate::sequence::{Position, position};

/// What the decode stage reads of one delivery: a lapin delivery's
/// parts, or a built event's (the test harness). An event takes the
/// properties and body; a poison delivery keeps them.
pub(crate) struct Incoming<'a> {
    pub(crate) properties: &'a mut BasicProperties,
    pub(crate) data: &'a mut Vec<u8>,
    pub(crate) redelivered: bool,
}

impl<'a> From<&'a mut Delivery> for Incoming<'a> {
    fn from(d: &'a mut Delivery) -> Self {
        Self {
            properties: &mut d.properties,
            data: &mut d.data,
            redelivered: d.redelivered,
        }
    }
}

/// A delivery that could not be decoded.
pub(crate) struct Poison {
    /// Why (the dead-letter reason, after `poison message: `).
    pub(super) reason: String,
    pub(super) span: Span,
    /// Its `message_id`, for the log line.
    pub(super) message_id: Option<String>,
}

/// A batch's deliveries decoded.
pub(crate) struct Decoded {
    /// Per delivery: the index of its event, or why it is poison.
    pub(crate) slots: Vec<std::result::Result<usize, Poison>>,
    /// Per event, its position when sequencing is on; otherwise empty.
    pub(super) positions: Vec<Option<Position>>,
    /// One span per event.
    pub(super) spans: Vec<Span>,
    pub(crate) events: Vec<Event>,
}

/// The decode stage: an event, with its span, per decodable delivery;
/// poison stays in its delivery for the dead-letter copy.
pub(super) fn decode<'a>(
    cfg: &ConsumerConfig,
    deliveries: impl ExactSizeIterator<Item = Incoming<'a>>,
) -> Decoded {
    let name = cfg.consumer_name.as_str();
    let mut events = Vec::with_capacity(deliveries.len());
    let mut spans = Vec::with_capacity(deliveries.len());
    let mut positions = Vec::new();
    let ordered = cfg.sequencing.is_on();
    let mut slots = Vec::with_capacity(deliveries.len());
    for d in deliveries {
        let span = tracing::info_span!(
            "outbox_consumer.event",
            consumer = name,
            event_id = Empty,
            event_type = Empty,
            traceparent = Empty,
            trace_id = Empty,
            parent_span_id = Empty,
            span_id = Empty,
            redelivered = d.redelivered,
            duplicate = Empty,
            outcome = Empty,
        );
        let decoded = dedup_key(d.properties, d.data, &cfg.dedup_key).and_then(|id| {
            let at = if ordered {
                position(d.properties)?
            } else {
                None
            };
            Ok((id, at))
        });
        match decoded {
            Ok((id, at)) => {
                let event = Event {
                    id,
                    properties: std::mem::take(d.properties),
                    payload: std::mem::take(d.data),
                    redelivered: d.redelivered,
                };
                record_event(&span, &event);
                slots.push(Ok(events.len()));
                events.push(event);
                if ordered {
                    positions.push(at);
                }
                spans.push(span);
            }
            Err(reason) => slots.push(Err(Poison {
                reason,
                span,
                message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
            })),
        }
    }
    Decoded {
        slots,
        positions,
        spans,
        events,
    }
}

/// Records a decoded event's identity and trace context on its span.
fn record_event(span: &Span, event: &Event) {
    span.record("event_id", event.id());
    if let Some(t) = event.event_type() {
        span.record("event_type", t);
    }
    if let Some(tp) = event.traceparent() {
        span.record("traceparent", &*tp);
    }
    if let Some(t) = event.trace() {
        span.record("trace_id", t.trace_id.as_str());
        span.record("parent_span_id", t.parent_span_id.as_deref().unwrap_or(""));
        span.record("span_id", t.span_id.as_str());
    }
}
