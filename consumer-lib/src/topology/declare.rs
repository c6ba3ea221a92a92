//! The declarations both topologies share: the source exchange, a work
//! queue with its retry queue and dead-letter queue, and what a refused
//! declaration means.

use outbox_core::amqp::BrokerError;
use outbox_core::queues::{dead_letter_queue, retry_queue};
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ErrorKind, ExchangeKind};

use super::{QueueArgs, QueueType};
use crate::error::{Error, Result, bounded};

/// The durable topic exchange the relay publishes to.
pub(super) async fn declare_source_exchange(
    ch: &Channel,
    exchange: &str,
    t: Duration,
) -> Result<()> {
    bounded(
        "exchange.declare",
        t,
        ch.exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
}

/// A durable work queue with `extra` arguments, and its retry queue and
/// DLQ.
pub(super) async fn declare_work_queue(
    ch: &Channel,
    queue: &str,
    extra: FieldTable,
    q: QueueArgs,
    t: Duration,
) -> Result<()> {
    let mut args = extra;
    if q.queue_type == QueueType::Quorum {
        quorum(&mut args);
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(q.delivery_limit.into()),
        );
        dead_letter_to(&mut args, &dead_letter_queue(queue));
    }
    if let Some(max) = q.max_length {
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(max.into()));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
    }
    declare_queue(ch, queue, args, "queue.declare", t).await?;
    declare_retry_queues(ch, queue, q.queue_type, t).await
}

/// `x-queue-type=quorum`.
fn quorum(args: &mut FieldTable) {
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
}

/// Dead-letters to `target` through the default exchange (which routes by
/// queue name), confirmed: the broker keeps a message until the target has
/// accepted it (quorum queues only; needs `x-overflow=reject-publish`).
fn dead_letter_to(args: &mut FieldTable, target: &str) {
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(target.into()),
    );
    args.insert(
        "x-dead-letter-strategy".into(),
        AMQPValue::LongString("at-least-once".into()),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
}

/// Declares `<queue>.retry` and `<queue>.dlq`.
pub(crate) async fn declare_retry_queues(
    ch: &Channel,
    queue: &str,
    queue_type: QueueType,
    t: Duration,
) -> Result<()> {
    let mut retry_args = FieldTable::default();
    match queue_type {
        QueueType::Quorum => {
            quorum(&mut retry_args);
            dead_letter_to(&mut retry_args, queue);
        }
        QueueType::Classic => {
            // The default exchange routes by queue name: an expired retry
            // goes straight back to the work queue (unconfirmed).
            retry_args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            retry_args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(queue.into()),
            );
        }
    }
    declare_queue(
        ch,
        &retry_queue(queue),
        retry_args,
        "queue.declare (retry)",
        t,
    )
    .await?;
    let mut dlq_args = FieldTable::default();
    if queue_type == QueueType::Quorum {
        quorum(&mut dlq_args);
    }
    declare_queue(
        ch,
        &dead_letter_queue(queue),
        dlq_args,
        "queue.declare (dlq)",
        t,
    )
    .await
}

/// A durable queue; an existing one with other arguments is
/// [`Error::QueueMismatch`].
async fn declare_queue(
    ch: &Channel,
    queue: &str,
    args: FieldTable,
    what: &'static str,
    t: Duration,
) -> Result<()> {
    bounded(
        what,
        t,
        ch.queue_declare(queue.into(), QueueDeclareOptions::durable(), args),
    )
    .await
    .map(drop)
    .map_err(|e| mismatch(e, queue))
}

/// RabbitMQ answers a declaration at odds with the existing queue with
/// 406 `PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue
/// 'q' in vhost '/': received ... but current value is ...`.
fn mismatch(e: Error, queue: &str) -> Error {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match e {
        Error::Broker(BrokerError::Failed { source, .. })
            if matches!(source.kind(), ErrorKind::ProtocolError(amqp)
                if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)) =>
        {
            let detail = match source.kind() {
                ErrorKind::ProtocolError(amqp) => {
                    let text = amqp.get_message().as_str();
                    text.split_once(" - ").map_or(text, |(_, d)| d).to_owned()
                }
                _ => String::new(),
            };
            Error::QueueMismatch {
                queue: queue.to_owned(),
                detail,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError};

    use super::*;

    #[test]
    fn a_conflicting_declaration_names_the_queue_and_the_argument() {
        let refused = |kind, text: &str| {
            Error::Broker(BrokerError::Failed {
                what: "queue.declare",
                source: ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into(),
            })
        };
        let e = mismatch(
            refused(
                AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::PRECONDITIONFAILED),
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'stock' in vhost '/': received the value 'quorum' of type 'longstr' but current value is 'classic' of type 'longstr'",
            ),
            "stock",
        );
        assert!(!e.is_transient());
        let text = e.to_string();
        assert!(
            text.contains("\"stock\"") && text.contains("'x-queue-type'"),
            "{text}"
        );
        assert!(text.contains("QueueType::Classic"), "{text}");
        // Anything else stays what it is.
        let other = mismatch(
            refused(
                AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED),
                "NOT_ALLOWED - vhost",
            ),
            "stock",
        );
        assert!(matches!(other, Error::Broker(_)));
    }
}
