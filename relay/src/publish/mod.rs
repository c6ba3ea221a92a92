//! Publishing a batch with pipelined publisher confirms: the channel
//! ([`Publisher`]), sending (`send.rs`) and the receipts (`receipt.rs`).

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

use crate::error::{Error, Result};
use outbox_core::amqp::bounded;

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

impl Publisher {
    fn channel_failure(&self, err: &Error) -> Option<Receipt> {
        channel_failure(&self.conn, &self.channel, err)
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
