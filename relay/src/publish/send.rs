//! Sending a batch: checked messages handed to the channel in order, the
//! confirms collected later ([`SentBatch::receipts`]).

use outbox_core::amqp::BrokerError;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::{Channel, Connection, PublisherConfirm};
use tokio::time::Instant;

use crate::broker::blocked_now;
use crate::error::{Error, Result};
use crate::message::{Message, OutboxEvent};
use crate::publish::receipt::receipt_of;
use crate::publish::{Publisher, Receipt, channel_failure, panic_message, within};

impl Publisher {
    /// Checks the exchanges and hands every publishable event of the batch
    /// to the channel, all before `deadline` less the confirm timeout (the
    /// publish phase's share of the batch transaction's idle bound). The
    /// confirms are [`SentBatch::receipts`], awaited against `deadline`
    /// after the whole batch is on its way; meanwhile the channel can take
    /// the next batch (the log's reader keeps a few on the wire). `Err`
    /// means the connection failed: outcomes are unknown, the batch must be
    /// rolled back (retried without counting an attempt) and the publisher
    /// replaced. Events [`Receipt::NotSent`] were never handed to the
    /// channel (exchanges already checked stay known, so the next batch
    /// gets further).
    pub(crate) async fn send_batch(
        &mut self,
        events: &[OutboxEvent],
        default_exchange: &str,
        max_payload_bytes: usize,
        confirm_timeout: Duration,
        deadline: Instant,
    ) -> Result<SentBatch> {
        let frame_max = self.conn.configuration().frame_max() as usize;
        // Checks and publishes get the phase minus the confirm timeout, so
        // whatever was sent always has its full confirm timeout: a batch
        // squeezed by slow checks must not time its own confirms out (and
        // publish them again).
        let send_by = deadline
            .checked_sub(confirm_timeout)
            .unwrap_or_else(Instant::now);
        let mut sent = SentBatch {
            conn: self.conn.clone(),
            channel: self.channel.clone(),
            pending: Vec::new(),
            receipts: vec![None; events.len()],
            confirms_by: deadline,
            started: std::time::Instant::now(),
        };
        let messages = messages(events, default_exchange, max_payload_bytes, frame_max);
        let refused = match self
            .refused_exchanges(messages.iter().flatten().map(|m| &m.exchange), deadline)
            .await
        {
            Ok(refused) => refused,
            // Out of time before anything was sent: nothing to settle.
            Err(Error::Broker(BrokerError::TimedOut { .. })) if blocked_now(&self.conn) => {
                return Err(Error::Broker(BrokerError::Blocked {
                    what: "the exchanges' check",
                }));
            }
            Err(Error::Broker(BrokerError::TimedOut { .. })) if Instant::now() >= deadline => {
                sent.receipts = vec![Some(Receipt::NotSent); events.len()];
                return Ok(sent);
            }
            Err(e) => return Err(e),
        };
        sent.started = std::time::Instant::now();
        sent.pending = self
            .send_all(events, messages, &refused, send_by, &mut sent.receipts)
            .await?;
        // Every publish is on the wire; the confirms are collected against
        // one deadline.
        sent.confirms_by = deadline.min(Instant::now() + confirm_timeout);
        Ok(sent)
    }

    /// Hands every publishable message to the channel (until `send_by`),
    /// in order; records the receipt of each one not sent. Returns the
    /// confirms to await, with the events' indexes.
    ///
    /// Every message's frames are queued for lapin's IO loop before any
    /// write is awaited: `basic_publish` resolves only once the IO loop has
    /// written its frames, so awaiting each in turn would cost a hand-off
    /// between the two tasks per message instead of about one per batch.
    /// The first poll of a publish takes its delivery tag and queues its
    /// frames, so the wire order is the batch's.
    async fn send_all(
        &mut self,
        events: &[OutboxEvent],
        messages: Vec<Result<Message, Receipt>>,
        refused: &HashMap<String, Receipt>,
        send_by: Instant,
        receipts: &mut [Option<Receipt>],
    ) -> Result<Vec<(usize, PublisherConfirm)>> {
        let opts = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let channel = &self.channel;
        let mut handed = Vec::with_capacity(events.len());
        // Ordered aggregates whose earlier event in this batch could not be
        // published: their later events must not overtake it.
        let mut halted: HashSet<(&str, &str)> = HashSet::new();
        for (i, (e, message)) in events.iter().zip(messages).enumerate() {
            let aggregate = (e.aggregate_type.as_str(), e.aggregate_id.as_str());
            let ordered = e.aggregate_seq.is_some();
            let held = ordered && halted.contains(&aggregate);
            let message = match sendable(message, held, send_by, refused) {
                Ok(m) => m,
                Err(receipt) => {
                    if ordered {
                        halted.insert(aggregate);
                    }
                    receipts[i] = Some(receipt);
                    continue;
                }
            };
            #[cfg(feature = "fault-injection")]
            crate::fault::inject(e, &self.channel, self.broker_timeout).await;
            let mut publish = Box::pin(channel.basic_publish(
                message.exchange,
                message.routing_key,
                opts,
                e.payload.as_bytes(),
                message.properties,
            ));
            // Queues the frames; resolves at once only on a closed channel.
            let first = std::future::poll_fn(|cx| Poll::Ready(publish.as_mut().poll(cx))).await;
            let handed_now = match first {
                Poll::Ready(r) => Handed::Done(r),
                Poll::Pending => Handed::Writing(publish),
            };
            handed.push((i, handed_now));
        }
        self.written(handed, send_by, receipts).await
    }

    /// Awaits, in order, the writes of the publishes [`Publisher::send_all`]
    /// handed to the channel; records the receipt of each one not written.
    /// Returns the confirms to await, with the events' indexes.
    async fn written<F>(
        &self,
        handed: Vec<(usize, Handed<F>)>,
        send_by: Instant,
        receipts: &mut [Option<Receipt>],
    ) -> Result<Vec<(usize, PublisherConfirm)>>
    where
        F: Future<Output = lapin::Result<PublisherConfirm>>,
    {
        let mut pending = Vec::with_capacity(handed.len());
        for (i, handed) in handed {
            let written = match handed {
                Handed::Done(r) => r.map_err(|source| {
                    Error::Broker(BrokerError::Failed {
                        what: "basic.publish",
                        source,
                    })
                }),
                Handed::Writing(f) => {
                    within("basic.publish", self.broker_timeout, send_by, f).await
                }
            };
            match written {
                Ok(confirm) => pending.push((i, confirm)),
                // A blocked connection (memory or disk alarm) writes
                // nothing: the broker's state, not the event's, so no
                // attempt is counted (the batch rolls back).
                Err(Error::Broker(BrokerError::TimedOut { .. })) if blocked_now(&self.conn) => {
                    return Err(Error::Broker(BrokerError::Blocked {
                        what: "basic.publish",
                    }));
                }
                // Its frames may still go out: not delivered as far as we
                // know, and the publisher is replaced.
                Err(Error::Broker(BrokerError::TimedOut { .. })) if Instant::now() >= send_by => {
                    receipts[i] = Some(Receipt::TimedOut);
                }
                Err(err) => match self.channel_failure(&err) {
                    Some(receipt) => {
                        receipts[i] = Some(receipt);
                        break;
                    }
                    None => return Err(err),
                },
            }
        }
        Ok(pending)
    }
}

/// A publish handed to the channel: its frames queued, the write either
/// known already or still to await.
enum Handed<F> {
    Done(lapin::Result<PublisherConfirm>),
    Writing(std::pin::Pin<Box<F>>),
}

/// The message to send, or the receipt of an event not sent: held back
/// behind its aggregate's failed event, out of time, unpublishable, or
/// for an exchange refused.
fn sendable(
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
/// [`Publisher::send_batch`]). It holds its own handles on the connection
/// and channel, so it can be awaited while the publisher sends more.
pub(crate) struct SentBatch {
    conn: Arc<Connection>,
    channel: Channel,
    /// The confirms to await, with the events' indexes.
    pending: Vec<(usize, PublisherConfirm)>,
    /// What is known already (events not sent, and why).
    receipts: Vec<Option<Receipt>>,
    confirms_by: Instant,
    started: std::time::Instant,
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
fn messages(
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
