//! Testing only (feature `fault-injection`, never in a release build):
//! events that make the relay fail on purpose, so the tests can prove a
//! panicking batch is isolated and one worker's channel failure restarts
//! every worker. The publish stage calls [`inject`] before each publish;
//! nothing else of the engine knows of it.

use std::time::Duration;

use lapin::Channel;

use crate::message::OutboxEvent;

/// An event of this type makes the worker publishing it panic.
pub const FAULT_PANIC_EVENT_TYPE: &str = "outbox-relay.fault-injection.panic";

/// The worker about to publish an event of this type on its first attempt
/// closes its own channel (not the connection) first.
pub const FAULT_CHANNEL_EVENT_TYPE: &str = "outbox-relay.fault-injection.close-channel";

/// Before `e` is published on `channel`: panics on
/// [`FAULT_PANIC_EVENT_TYPE`]; closes the channel (within `timeout`) before
/// the first attempt of [`FAULT_CHANNEL_EVENT_TYPE`].
pub(crate) async fn inject(e: &OutboxEvent, channel: &Channel, timeout: Duration) {
    if e.event_type == FAULT_PANIC_EVENT_TYPE {
        panic!("fault injection: event {} asked the relay to panic", e.id);
    }
    if e.event_type == FAULT_CHANNEL_EVENT_TYPE && e.attempts == 0 {
        let close = channel.close(200, "fault injection".into());
        let _ = tokio::time::timeout(timeout, close).await;
    }
}
