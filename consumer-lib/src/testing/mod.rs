//! A test harness for your handlers (feature `testing`): run a
//! [`Handler`](crate::Handler) against a real test database on built
//! events, without RabbitMQ, through the consumer's own batch code, and
//! see what a running consumer would have done with each message.
//!
//! - [`TestSchema`] (from `outbox::testing`): a fresh schema per test,
//!   dropped afterwards; migrate it as your service does.
//! - [`EventBuilder`]: an [`Event`](crate::Event) as the relay publishes
//!   it, from scratch or from what a producer enqueued
//!   ([`enqueued`]: the events a transaction wrote to the outbox).
//! - [`TestConsumer`]: delivers events one at a time or as a batch;
//!   [`Delivered`] says applied, duplicate, stale, retried, deferred or
//!   dead-lettered, with the reason.
//!
//! Dedup, sequencing and outcomes behave as in production because they
//! are the production code: the same inbox record, sequence locks,
//! savepoints, conflict reruns and retry budgets. What a test does not
//! get is the broker's side: redelivery after a crash, the retry queue's
//! delay (deliver the event again, built with
//! [`EventBuilder::retry_count`], to see its next attempt), the delivery
//! limit. See [`TestConsumer`] for an example.

mod consumer;
mod event;

pub use self::consumer::{Delivered, TestConsumer};
pub use self::event::EventBuilder;
pub use outbox::testing::{Enqueued, TestSchema, enqueued};
