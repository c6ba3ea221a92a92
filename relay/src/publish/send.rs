//! A batch on its way ([`SentBatch`]): the confirms of the messages
//! [`Publisher::send_batch`](super::Publisher::send_batch) handed to the channel in order, collected
//! later ([`SentBatch::receipts`]), and the helpers of the sending.

use outbox_core::amqp::BrokerError;
use std::collections::HashMap;
use std::sync::Arc;

use lapin::{Channel, Connection, PublisherConfirm};
use tokio::time::Instant;

use crate::broker::blocked_now;
use crate::error::{Error, Result};
use crate::message::{Message, OutboxEvent};
use crate::publish::receipt::receipt_of;
use crate::publish::{Receipt, channel_failure, panic_message};

/// A publish handed to the channel: its frames queued, the write either
/// known already or still to await.
pub(super) enum Handed<F> {
    Done(lapin::Result<PublisherConfirm>),
    Writing(std::pin::Pin<Box<F>>),
}

/// The message to send, or the receipt of an event not sent: held back
/// behind its aggregate's failed event, out of time, unpublishable, or
/// for an exchange refused.
pub(super) fn sendable(
    message: Result<Message, Receipt>,
    held: bool,
    send_by: Instant,
    refused: &HashMap<String, Receipt>,
) -> Result<Message, Receipt> {
    if held {
        Err(Receipt::HeldBack)
    } else if Instant::now() >= send_by {
        Err(Receipt::NotSent)
    } else {
        message.and_then(|m| match refused.get(m.exchange.as_str()) {
            Some(receipt) => Err(receipt.clone()),
            None => Ok(m),
        })
    }
}

/// A batch on the channel whose confirms are still to come (from
/// [`Publisher::send_batch`](super::Publisher::send_batch)). It holds its own handles on the connection
/// and channel, so it can be awaited while the publisher sends more.
pub(crate) struct SentBatch {
    pub(super) conn: Arc<Connection>,
    pub(super) channel: Channel,
    /// The confirms to await, with the events' indexes.
    pub(super) pending: Vec<(usize, PublisherConfirm)>,
    /// What is known already (events not sent, and why).
    pub(super) receipts: Vec<Option<Receipt>>,
    pub(super) confirms_by: Instant,
    pub(super) started: std::time::Instant,
}

impl SentBatch {
    /// Awaits the confirms until the batch's deadline, in order (no extra
    /// round trips: they are all in flight already); returns one receipt
    /// per event, in order. `Err` means the connection failed.
    /// [`Receipt::TimedOut`] means the publisher should be replaced, after
    /// the batch is settled.
    pub(crate) async fn receipts(mut self) -> Result<Vec<Receipt>> {
        let pending = std::mem::take(&mut self.pending);
        let sent = !pending.is_empty();
        for (i, confirm) in pending {
            self.receipts[i] = Some(
                match tokio::time::timeout_at(self.confirms_by, confirm).await {
                    // A blocked connection (memory or disk alarm) is the
                    // broker's state, not the event's: no attempt is counted.
                    Err(_) if blocked_now(&self.conn) => {
                        return Err(Error::Broker(BrokerError::Blocked {
                            what: "publisher confirms",
                        }));
                    }
                    Err(_) => Receipt::TimedOut,
                    Ok(Err(err)) => {
                        let err = Error::Broker(BrokerError::Failed {
                            what: "publisher confirm",
                            source: err,
                        });
                        match channel_failure(&self.conn, &self.channel, &err) {
                            Some(receipt) => receipt,
                            None => return Err(err),
                        }
                    }
                    Ok(Ok(confirmation)) => receipt_of(confirmation),
                },
            );
        }
        // From the first publish to the last confirm collected: for the
        // log's reader, which collects a batch only after the ones before
        // it, that includes waiting behind them.
        if sent {
            metrics::histogram!("outbox_relay_confirm_seconds")
                .record(self.started.elapsed().as_secs_f64());
        }
        // Events not published because the channel failed before them share
        // that failure (their attempt is counted; backoff separates them
        // from the culprit next time).
        let failed = self.receipts.iter().flatten().find_map(|o| match o {
            Receipt::ChannelFailed(e) => Some(e.clone()),
            _ => None,
        });
        Ok(self
            .receipts
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Receipt::ChannelFailed(failed.clone().unwrap_or_default()))
            })
            .collect())
    }
}

/// Every event's message, converted (and so checked) before anything
/// reaches lapin, whose conversions panic on what AMQP cannot carry; or
/// why it can never be published.
pub(super) fn messages(
    events: &[OutboxEvent],
    default_exchange: &str,
    max_payload_bytes: usize,
    frame_max: usize,
) -> Vec<Result<Message, Receipt>> {
    events
        .iter()
        .map(|e| {
            if e.payload.len() > max_payload_bytes {
                return Err(Receipt::TooLarge {
                    size: e.payload.len(),
                    limit: max_payload_bytes,
                });
            }
            convert(e, default_exchange, frame_max)
        })
        .collect()
}

/// The event's message, or why it can never be published. The conversion
/// is total by construction and fuzzed; should it ever panic, that event
/// alone is refused (as a relay bug) instead of the whole batch failing.
fn convert(e: &OutboxEvent, default_exchange: &str, frame_max: usize) -> Result<Message, Receipt> {
    match std::panic::catch_unwind(|| e.to_message(default_exchange, frame_max)) {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(why)) => Err(Receipt::Unpublishable(why)),
        Err(panic) => Err(Receipt::Unpublishable(format!(
            "the relay panicked converting this event (a relay bug; please report it): {}",
            panic_message(&*panic)
        ))),
    }
}
