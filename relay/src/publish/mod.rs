//! Publishing a batch with pipelined publisher confirms: the channel
//! ([`Publisher`], all of it here: opening, the known exchanges, sending a
//! batch, what its receipts say about the channel), a batch on its way
//! (`send.rs`: [`SentBatch`], its confirms collected later) and the
//! receipts (`receipt.rs`: [`Receipt`], read from a confirm).

mod receipt;
mod send;

use outbox_core::amqp::BrokerError;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::broker::blocked_now;
use crate::error::{Error, Result};
use crate::message::{Message, OutboxEvent};
use outbox_core::amqp::bounded;
use std::task::Poll;

use lapin::PublisherConfirm;
use lapin::options::BasicPublishOptions;

use self::send::{Handed, SentBatch, messages, sendable};

pub(crate) use receipt::Receipt;

/// What publishing a batch takes of the relay's configuration (the
/// table's workers and the log's reader alike).
#[derive(Debug, Clone)]
pub(crate) struct PublishSettings {
    /// The exchange of events that name none.
    pub(crate) default_exchange: String,
    /// Larger payloads are refused (dead-lettered), not published.
    pub(crate) max_payload_bytes: usize,
    /// How long the confirms of a batch may take.
    pub(crate) confirm_timeout: Duration,
    /// Every other broker call's bound.
    pub(crate) broker_timeout: Duration,
    /// The longest a batch's publish phase may take
    /// (`RelayConfig::publish_phase`).
    pub(crate) phase: Duration,
}

impl PublishSettings {
    pub(crate) fn new(config: &crate::config::RelayConfig) -> Self {
        Self {
            default_exchange: config.default_exchange.clone(),
            max_payload_bytes: config.max_payload_bytes,
            confirm_timeout: config.confirm_timeout,
            broker_timeout: config.broker_timeout,
            phase: config.publish_phase(),
        }
    }
}

/// One confirm-mode channel, used by one worker.
pub(crate) struct Publisher {
    conn: Arc<Connection>,
    channel: Channel,
    /// Exchanges seen to exist; cleared whenever the channel is replaced.
    known_exchanges: HashSet<String>,
    broker_timeout: Duration,
}

impl Publisher {
    pub(crate) async fn open(conn: &Arc<Connection>, broker_timeout: Duration) -> Result<Self> {
        let channel = bounded("channel open", broker_timeout, conn.create_channel()).await?;
        bounded(
            "confirm.select",
            broker_timeout,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let mut known_exchanges = HashSet::new();
        known_exchanges.insert(String::new()); // the default exchange always exists
        Ok(Self {
            conn: conn.clone(),
            channel,
            known_exchanges,
            broker_timeout,
        })
    }

    /// Closes the channel (bounded), before its connection closes: closing
    /// a connection under open channels makes lapin log errors. Not while
    /// the broker blocks the connection: nothing it writes goes out.
    pub(crate) async fn close(&self) {
        if self.channel.status().connected() && !crate::broker::blocked_now(&self.conn) {
            let _ =
                tokio::time::timeout(self.broker_timeout, self.channel.close(200, "bye".into()))
                    .await;
        }
    }

    /// Whether the connection and channel are still usable.
    pub(crate) fn is_open(&self) -> bool {
        self.conn.status().connected() && self.channel.status().connected()
    }

    /// Passive-declares exchanges not seen before, each on a throwaway
    /// channel (a missing exchange closes the channel that asked). Returns
    /// the refused ones with the reason: missing, or refused otherwise
    /// while the connection stayed up (a channel-level answer about that
    /// exchange). `Err` only when the connection failed or the deadline
    /// passed.
    async fn refused_exchanges<'a>(
        &mut self,
        names: impl Iterator<Item = &'a ShortString>,
        deadline: Instant,
    ) -> Result<HashMap<String, Receipt>> {
        let mut refused = HashMap::new();
        let unknown: HashSet<&ShortString> = names
            .filter(|n| !self.known_exchanges.contains(n.as_str()))
            .collect();
        for name in unknown {
            let ch = within(
                "channel open",
                self.broker_timeout,
                deadline,
                self.conn.create_channel(),
            )
            .await?;
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let r = within(
                "exchange.declare (passive)",
                self.broker_timeout,
                deadline,
                ch.exchange_declare(
                    name.clone(),
                    ExchangeKind::Topic,
                    passive,
                    FieldTable::default(),
                ),
            )
            .await;
            match r {
                Ok(()) => {
                    self.known_exchanges.insert(name.to_string());
                    // Within the phase too: a slow close must not stretch it.
                    let by = deadline.min(Instant::now() + self.broker_timeout);
                    let _ = tokio::time::timeout_at(by, ch.close(200, "OK".into())).await;
                }
                Err(Error::Broker(BrokerError::Failed { source: e, .. })) if is_not_found(&e) => {
                    refused.insert(
                        name.to_string(),
                        Receipt::ExchangeNotFound(name.to_string()),
                    );
                }
                Err(Error::Broker(BrokerError::Failed { source: e, .. }))
                    if self.conn.status().connected() =>
                {
                    refused.insert(
                        name.to_string(),
                        Receipt::ExchangeRefused {
                            exchange: name.to_string(),
                            reason: e.to_string(),
                        },
                    );
                }
                Err(e) => return Err(e),
            }
        }
        Ok(refused)
    }

    fn channel_failure(&self, err: &Error) -> Option<Receipt> {
        channel_failure(&self.conn, &self.channel, err)
    }

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

    /// What the receipts say about the channel (a table batch's, or the
    /// log reader's): confirms that timed out or a failed channel end the
    /// session (`Err`); nacks replace the channel.
    pub(crate) async fn after_receipts(
        &mut self,
        conn: &Arc<Connection>,
        receipts: &[Receipt],
        confirm_timeout: Duration,
    ) -> Result<()> {
        if receipts.contains(&Receipt::TimedOut) {
            // Confirms may still arrive on this channel; start afresh.
            return Err(Error::Broker(BrokerError::TimedOut {
                what: "publisher confirms",
                timeout: confirm_timeout,
            }));
        }
        if let Some(Receipt::ChannelFailed(e)) = receipts
            .iter()
            .find(|o| matches!(o, Receipt::ChannelFailed(_)))
        {
            // Settled; now replace the closed channel.
            return Err(Error::Broker(BrokerError::ChannelClosed(e.clone())));
        }
        if receipts.contains(&Receipt::Nacked) {
            // Settled (retried later). A channel that published to a
            // quorum queue while its leader changed can go on nacking
            // every publish (seen on RabbitMQ 3.10 after a node was
            // killed) while a fresh channel is acked: replace it. Nacks
            // are otherwise rare (a full queue refusing publishes).
            self.close().await;
            *self = Publisher::open(conn, self.broker_timeout).await?;
        }
        Ok(())
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// `f` bounded by `timeout` and by `deadline`, whichever comes first.
pub(super) async fn within<T>(
    what: &'static str,
    timeout: Duration,
    deadline: Instant,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T> {
    let by = deadline.min(Instant::now() + timeout);
    match tokio::time::timeout_at(by, f).await {
        Ok(r) => r.map_err(|source| Error::Broker(BrokerError::Failed { what, source })),
        Err(_) => Err(Error::Broker(BrokerError::TimedOut { what, timeout })),
    }
}

/// `Some` when the channel failed but the connection is up: the failure
/// belongs to this batch's events, not to the broker as a whole.
pub(super) fn channel_failure(
    conn: &Connection,
    channel: &Channel,
    err: &Error,
) -> Option<Receipt> {
    let channel_only = conn.status().connected() && !channel.status().connected();
    channel_only.then(|| Receipt::ChannelFailed(err.to_string()))
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
}
