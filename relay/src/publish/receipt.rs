//! The broker's receipt for one event, read from its confirm
//! ([`Publisher::after_receipts`](super::Publisher::after_receipts) reads what a batch's receipts say about
//! the channel that carried it).

use lapin::Confirmation;

/// The broker's receipt for one event: what became of its publish (see the
/// glossary in the crate docs).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Receipt {
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
    /// Not sent by the log's reader: its ordered aggregate has events in
    /// the outbox table, so it goes there too, behind them (no attempt
    /// counted).
    Queued,
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
    pub(crate) fn error(&self) -> Option<String> {
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
            Receipt::Queued => {
                Some("queued behind earlier events of its aggregate in the outbox table".to_owned())
            }
            Receipt::NotSent => {
                Some("not sent: the batch's publish deadline passed before its turn".to_owned())
            }
            Receipt::TooLarge { size, limit } => Some(format!(
                "payload is {size} bytes, over the relay's limit of {limit} bytes"
            )),
        }
    }

    /// True when retrying cannot help.
    pub(crate) fn is_permanent(&self) -> bool {
        matches!(self, Receipt::TooLarge { .. } | Receipt::Unpublishable(_))
    }
}

/// The receipt a broker confirm gives.
pub(super) fn receipt_of(confirmation: Confirmation) -> Receipt {
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
