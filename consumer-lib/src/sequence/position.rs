//! Where a sequenced event stands in its aggregate, read from its
//! headers.

use std::borrow::Cow;

use lapin::BasicProperties;
use lapin::types::AMQPValue;
use outbox::wire;

use crate::event::{MAX_DEDUP_KEY_BYTES, amqp_int, amqp_text};

/// One aggregate: `x-aggregate-type` and `x-aggregate-id`. Ordered by
/// type, then id: the order in which a batch locks its rows.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Aggregate {
    pub(crate) kind: String,
    pub(crate) id: String,
}

/// Where a sequenced event stands in its aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) aggregate: Aggregate,
    pub(crate) seq: i64,
}

/// The position of a message: `Ok(None)` without `x-aggregate-seq` (an
/// unordered event); `Err` holds why the message is poison.
pub(crate) fn position(props: &BasicProperties) -> Result<Option<Position>, String> {
    let Some(headers) = props.headers().as_ref().map(|h| h.inner()) else {
        return Ok(None);
    };
    let Some(raw) = headers.get(wire::HEADER_AGGREGATE_SEQ) else {
        return Ok(None);
    };
    let seq = match raw {
        // A timestamp is an integer on the wire but not a sequence number.
        AMQPValue::Timestamp(_) => None,
        v => amqp_int(v),
    }
    .filter(|&n| n >= 1)
    .ok_or_else(|| {
        format!(
            "header {} must be an integer of at least 1, got {raw:?}",
            wire::HEADER_AGGREGATE_SEQ
        )
    })?;
    let text = |name: &str| -> Result<String, String> {
        let value = headers
            .get(name)
            .and_then(amqp_text)
            .map(Cow::into_owned)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                format!(
                    "a sequenced event (header {}) needs a non-empty header {name}",
                    wire::HEADER_AGGREGATE_SEQ
                )
            })?;
        // PostgreSQL refuses NUL in text and a B-tree entry must fit a
        // page: such a key could never be locked, the batch never commit.
        if value.contains('\0') || value.len() > MAX_DEDUP_KEY_BYTES {
            return Err(format!(
                "header {name} contains a NUL character or exceeds {MAX_DEDUP_KEY_BYTES} bytes"
            ));
        }
        Ok(value)
    };
    Ok(Some(Position {
        aggregate: Aggregate {
            kind: text(wire::HEADER_AGGREGATE_TYPE)?,
            id: text(wire::HEADER_AGGREGATE_ID)?,
        },
        seq,
    }))
}
