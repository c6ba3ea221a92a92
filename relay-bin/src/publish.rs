//! Publishing a batch with pipelined publisher confirms.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{FieldTable, ShortString};

use lapin::{
    Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind, PublisherConfirm,
};

use crate::error::{Error, Result};
use crate::message::{ClaimedEvent, Message};
use outbox_core::amqp::bounded;

/// The broker's receipt for one event: what became of its publish (see the
/// glossary in the crate docs).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Receipt {
    /// Acked and not returned: the broker has it. Only this counts as
    /// delivered.
    Delivered,
    /// The broker refused it (for example a full queue with
    /// `reject-publish` overflow).
    Nacked,
    /// Unroutable: returned under `mandatory` (no queue bound for it).
    Returned {
        /// AMQP reply code (312 `NO_ROUTE`).
        code: u16,
        /// Broker's reply text.
        text: String,
    },
    /// No confirm within the confirm timeout: not delivered as far as we
    /// know (it may still arrive; the consumer absorbs the duplicate).
    TimedOut,
    /// The exchange does not exist.
    ExchangeNotFound(String),
    /// The broker refused the passive check of the exchange for another
    /// reason than its absence (403 `ACCESS_REFUSED`, say). Counted as an
    /// attempt, like a missing exchange.
    ExchangeRefused {
        /// The exchange.
        exchange: String,
        /// What the broker said.
        reason: String,
    },
    /// Not sent: the batch's publish deadline passed first. Left in the
    /// outbox untouched (no attempt counted).
    NotSent,
    /// The channel failed while the connection stayed up: a channel-level
    /// refusal (403 on an exchange, a message over the broker's size
    /// limit, ...). Counted as an attempt so a poison event cannot stall
    /// its batch for ever; the publisher is replaced.
    ChannelFailed(String),
    /// The event can never be published as it is (a name over AMQP's
    /// 255-byte limit, headers that are not a JSON object or do not fit
    /// one frame, ...); it is dead-lettered at once with the reason.
    Unpublishable(String),
    /// Not published: an earlier event of its (ordered) aggregate in the
    /// same batch could not be published. Left in the outbox untouched.
    HeldBack,
    /// The payload is over the relay's limit; it is dead-lettered at once.
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The limit.
        limit: usize,
    },
}

impl Receipt {
    /// The text recorded as `last_error` (`None` for a delivery).
    pub fn error(&self) -> Option<String> {
        match self {
            Receipt::Delivered => None,
            Receipt::Nacked => Some("nacked by the broker".to_owned()),
            Receipt::Returned { code, text } => Some(format!(
                "returned by the broker: {code} {text} (no queue is bound for this exchange and routing key)"
            )),
            Receipt::TimedOut => Some("no publisher confirm within the confirm timeout".to_owned()),
            Receipt::ChannelFailed(e) => Some(format!("the broker closed the channel: {e}")),
            Receipt::Unpublishable(why) => Some(why.clone()),
            Receipt::HeldBack => {
                Some("held back behind an earlier event of its aggregate".to_owned())
            }
            Receipt::ExchangeNotFound(x) => Some(format!("exchange {x:?} does not exist")),
            Receipt::ExchangeRefused { exchange, reason } => Some(format!(
                "the broker refused the check of exchange {exchange:?}: {reason}"
            )),
            Receipt::NotSent => {
                Some("not sent: the batch's publish deadline passed before its turn".to_owned())
            }
            Receipt::TooLarge { size, limit } => Some(format!(
                "payload is {size} bytes, over the relay's limit of {limit} bytes"
            )),
        }
    }

    /// True when retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        matches!(self, Receipt::TooLarge { .. } | Receipt::Unpublishable(_))
    }
}

/// Connects to the first of `urls` that answers, from `start`
/// ([`outbox_core::amqp::connect_any`]); returns the connection and the
/// index of its URL.
pub(crate) async fn connect_any(
    urls: &[String],
    start: usize,
    timeout: Duration,
) -> Result<(Connection, usize)> {
    let props = ConnectionProperties::default().with_connection_name("outbox-relay".into());
    Ok(outbox_core::amqp::connect_any(urls, start, timeout, props).await?)
}

/// Declares `name` durable with `kind`, idempotently.
pub(crate) async fn declare_exchange(
    conn: &Connection,
    name: &str,
    kind: &str,
    timeout: Duration,
) -> Result<()> {
    let ch = bounded("channel open", timeout, conn.create_channel()).await?;
    let kind = match kind {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        _ => ExchangeKind::Topic,
    };
    let opts = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(
        "exchange.declare",
        timeout,
        ch.exchange_declare(name.into(), kind, opts, FieldTable::default()),
    )
    .await?;
    let _ = bounded("channel close", timeout, ch.close(200, "OK".into())).await;
    Ok(())
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
    /// a connection under open channels makes lapin log errors.
    pub(crate) async fn close(&self) {
        if self.channel.status().connected() {
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
                Err(Error::Broker { source: e, .. }) if is_not_found(&e) => {
                    refused.insert(
                        name.to_string(),
                        Receipt::ExchangeNotFound(name.to_string()),
                    );
                }
                Err(Error::Broker { source: e, .. }) if self.conn.status().connected() => {
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

    /// Publishes every event of the batch, then awaits all confirms at once,
    /// all before `deadline` (the publish phase's share of the batch
    /// transaction's idle bound). Returns one outcome per event, in order.
    /// `Err` means the connection failed: outcomes are unknown, the batch
    /// must be rolled back (retried without counting an attempt) and the
    /// publisher replaced. [`Receipt::TimedOut`] also means the publisher
    /// should be replaced, after the batch is settled; events
    /// [`Receipt::NotSent`] were never handed to the channel (exchanges
    /// already checked stay known, so the next batch gets further).
    pub(crate) async fn publish_batch(
        &mut self,
        events: &[ClaimedEvent],
        default_exchange: &str,
        max_payload_bytes: usize,
        confirm_timeout: Duration,
        deadline: Instant,
    ) -> Result<Vec<Receipt>> {
        self.send_batch(
            events,
            default_exchange,
            max_payload_bytes,
            confirm_timeout,
            deadline,
        )
        .await?
        .receipts()
        .await
    }

    /// The first half of [`Publisher::publish_batch`]: checks the exchanges
    /// and hands every publishable event to the channel. The confirms are
    /// [`SentBatch::receipts`]; meanwhile the channel can take the next
    /// batch (the log's reader keeps a few on the wire).
    pub(crate) async fn send_batch(
        &mut self,
        events: &[ClaimedEvent],
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
            confirm_timeout,
            started: std::time::Instant::now(),
        };
        let messages = messages(events, default_exchange, max_payload_bytes, frame_max);
        let refused = match self
            .refused_exchanges(messages.iter().flatten().map(|m| &m.exchange), deadline)
            .await
        {
            Ok(refused) => refused,
            // Out of time before anything was sent: nothing to settle.
            Err(Error::BrokerTimeout { .. }) if Instant::now() >= deadline => {
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
    async fn send_all(
        &mut self,
        events: &[ClaimedEvent],
        messages: Vec<Result<Message, Receipt>>,
        refused: &HashMap<String, Receipt>,
        send_by: Instant,
        receipts: &mut [Option<Receipt>],
    ) -> Result<Vec<(usize, PublisherConfirm)>> {
        let mut pending = Vec::with_capacity(events.len());
        let opts = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        // Ordered aggregates whose earlier event in this batch could not be
        // published: their later events must not overtake it.
        let mut halted: HashSet<(&str, &str)> = HashSet::new();
        for (i, (e, message)) in events.iter().zip(messages).enumerate() {
            let aggregate = (e.aggregate_type.as_str(), e.aggregate_id.as_str());
            let ordered = e.aggregate_seq.is_some();
            let refusal = if ordered && halted.contains(&aggregate) {
                Err(Receipt::HeldBack)
            } else if Instant::now() >= send_by {
                Err(Receipt::NotSent)
            } else {
                message.and_then(|m| match refused.get(m.exchange.as_str()) {
                    Some(receipt) => Err(receipt.clone()),
                    None => Ok(m),
                })
            };
            let message = match refusal {
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
            if e.event_type == crate::FAULT_PANIC_EVENT_TYPE {
                panic!("fault injection: event {} asked the relay to panic", e.id);
            }
            #[cfg(feature = "fault-injection")]
            if e.event_type == crate::FAULT_CHANNEL_EVENT_TYPE && e.attempts == 0 {
                let close = self.channel.close(200, "fault injection".into());
                let _ = tokio::time::timeout(self.broker_timeout, close).await;
            }
            // Hands the frames to lapin's IO loop; the confirm comes later.
            let published = within(
                "basic.publish",
                self.broker_timeout,
                send_by,
                self.channel.basic_publish(
                    message.exchange,
                    message.routing_key,
                    opts,
                    e.payload.as_bytes(),
                    message.properties,
                ),
            )
            .await;
            match published {
                Ok(confirm) => pending.push((i, confirm)),
                // Its frames may still go out: not delivered as far as we
                // know, and the publisher is replaced.
                Err(Error::BrokerTimeout { .. }) if Instant::now() >= send_by => {
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
    confirm_timeout: Duration,
    started: std::time::Instant,
}

impl SentBatch {
    /// Awaits the confirms until the batch's deadline, in order (no extra
    /// round trips: they are all in flight already); returns one receipt
    /// per event, in order. `Err` means the connection failed.
    pub(crate) async fn receipts(mut self) -> Result<Vec<Receipt>> {
        let pending = std::mem::take(&mut self.pending);
        let sent = !pending.is_empty();
        for (i, confirm) in pending {
            self.receipts[i] = Some(
                match tokio::time::timeout_at(self.confirms_by, confirm).await {
                    // A blocked connection (memory or disk alarm) is the
                    // broker's state, not the event's: no attempt is counted.
                    Err(_) if self.conn.status().blocked() => {
                        return Err(Error::BrokerTimeout {
                            what: "publisher confirms (connection blocked by a broker resource alarm)",
                            timeout: self.confirm_timeout,
                        });
                    }
                    Err(_) => Receipt::TimedOut,
                    Ok(Err(err)) => {
                        let err = Error::Broker {
                            what: "publisher confirm",
                            source: err,
                        };
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
    events: &[ClaimedEvent],
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

/// The receipt a broker confirm gives.
fn receipt_of(confirmation: Confirmation) -> Receipt {
    match confirmation {
        Confirmation::Ack(None) => Receipt::Delivered,
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
            Receipt::Returned {
                code: returned.reply_code,
                text: returned.reply_text.to_string(),
            }
        }
        Confirmation::Nack(None) => Receipt::Nacked,
        // Confirm mode is always on; no confirm is no delivery.
        Confirmation::NotRequested => Receipt::Nacked,
    }
}

/// The event's message, or why it can never be published. The conversion
/// is total by construction and fuzzed; should it ever panic, that event
/// alone is refused (as a relay bug) instead of the whole batch failing.
fn convert(e: &ClaimedEvent, default_exchange: &str, frame_max: usize) -> Result<Message, Receipt> {
    match std::panic::catch_unwind(|| e.to_message(default_exchange, frame_max)) {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(why)) => Err(Receipt::Unpublishable(why)),
        Err(panic) => Err(Receipt::Unpublishable(format!(
            "the relay panicked converting this event (a relay bug; please report it): {}",
            panic_message(&*panic)
        ))),
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
async fn within<T>(
    what: &'static str,
    timeout: Duration,
    deadline: Instant,
    f: impl Future<Output = lapin::Result<T>>,
) -> Result<T> {
    let by = deadline.min(Instant::now() + timeout);
    match tokio::time::timeout_at(by, f).await {
        Ok(r) => r.map_err(|source| Error::Broker { what, source }),
        Err(_) => Err(Error::BrokerTimeout { what, timeout }),
    }
}

impl Publisher {
    fn channel_failure(&self, err: &Error) -> Option<Receipt> {
        channel_failure(&self.conn, &self.channel, err)
    }
}

/// `Some` when the channel failed but the connection is up: the failure
/// belongs to this batch's events, not to the broker as a whole.
fn channel_failure(conn: &Connection, channel: &Channel, err: &Error) -> Option<Receipt> {
    let channel_only = conn.status().connected() && !channel.status().connected();
    channel_only.then(|| Receipt::ChannelFailed(err.to_string()))
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
}
