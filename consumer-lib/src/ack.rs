//! The ack stage, after the batch's commit: republish retries, deferrals
//! and dead letters (confirmed), then ack. A message is acked only once
//! its copy is safely queued.

use outbox_core::amqp::BrokerError;
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicPublishOptions};
use lapin::types::AMQPValue;
use lapin::{Acker, BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use outbox::wire;
use outbox_core::amqp::{is_blocked, while_blocked};
use outbox_core::queues::DEATH_HISTORY;

use crate::error::{Error, Result, bounded_unblocked};
use crate::event::{HEADER_DEFERRAL_COUNT, HEADER_DELIVERY_COUNT};

/// What the ack stage does with one delivery of a committed batch (decided
/// from its [`Verdict`](crate::batch::Verdict) and the retry budgets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Effect committed, or a duplicate: just ack.
    Ack,
    /// Republish to the retry queue with `x-retry-count = attempt`,
    /// expiring after `delay`.
    Retry { attempt: u32, delay: Duration },
    /// Republish a deferred sequenced event to the retry queue with
    /// `x-deferral-count = deferral` (`x-retry-count` unchanged), expiring
    /// after `delay`.
    Defer { deferral: u32, delay: Duration },
    /// Republish to the dead-letter queue with `reason`.
    DeadLetter { reason: String },
}

pub(crate) struct AckItem<'a> {
    pub(crate) acker: &'a Acker,
    pub(crate) disposition: Disposition,
    pub(crate) properties: &'a BasicProperties,
    pub(crate) body: &'a [u8],
}

/// Republishes what needs it on the confirm-mode `channel`, awaits every
/// confirm, then acks the whole batch with one `multiple` ack. `Err`
/// leaves the batch unacked: the broker redelivers it and the inbox turns
/// the committed part into duplicates. Each wait is bounded by `timeout`
/// of time the broker does not block `conn`: through a resource alarm the
/// batch waits on the same connection (nothing it writes goes out until
/// the lift), not charged, not reconnected.
pub(crate) async fn acknowledge(
    conn: &Connection,
    channel: &Channel,
    queue: &str,
    consumer: &str,
    items: &[AckItem<'_>],
    timeout: Duration,
) -> Result<()> {
    let queues = Queues {
        retry: outbox_core::queues::retry_queue(queue),
        dead_letter: outbox_core::queues::dead_letter_queue(queue),
    };
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let mut pending = Vec::new();
    for item in items {
        let Some((target, props)) = copy_of(item, &queues, consumer) else {
            continue;
        };
        let confirm = bounded_unblocked(
            "basic.publish",
            timeout,
            conn,
            channel.basic_publish(
                "".into(),
                target.as_str().into(),
                mandatory,
                item.body,
                props,
            ),
        )
        .await?;
        pending.push((target, confirm));
    }
    await_confirms(conn, pending, timeout).await?;
    // Batches are settled in delivery order, so every earlier tag on this
    // channel is settled already: one `multiple` ack covers the batch.
    if let Some(last) = items.last() {
        bounded_unblocked(
            "basic.ack",
            timeout,
            conn,
            last.acker.ack(BasicAckOptions { multiple: true }),
        )
        .await?;
    }
    Ok(())
}

/// Where the copies go.
struct Queues {
    retry: String,
    dead_letter: String,
}

/// The queue and properties of the copy a delivery's disposition asks for
/// (`None` for a plain ack).
fn copy_of<'q>(
    item: &AckItem<'_>,
    queues: &'q Queues,
    consumer: &str,
) -> Option<(&'q String, BasicProperties)> {
    let (target, props) = match &item.disposition {
        Disposition::Ack => return None,
        Disposition::Retry { attempt, delay } => (
            &queues.retry,
            with_header(
                item.properties,
                wire::HEADER_RETRY_COUNT,
                AMQPValue::LongLongInt((*attempt).into()),
            )
            .with_expiration(delay.as_millis().max(1).to_string().into()),
        ),
        Disposition::Defer { deferral, delay } => (
            &queues.retry,
            with_header(
                item.properties,
                HEADER_DEFERRAL_COUNT,
                AMQPValue::LongLongInt((*deferral).into()),
            )
            .with_expiration(delay.as_millis().max(1).to_string().into()),
        ),
        Disposition::DeadLetter { reason } => (
            &queues.dead_letter,
            with_header(
                item.properties,
                wire::HEADER_DEAD_LETTER_REASON,
                AMQPValue::LongString(reason.as_str().into()),
            ),
        ),
    };
    // A retry goes back into `<queue>` through a dead-lettering hop; a
    // death history naming `<queue>` (a message the broker moved to the
    // DLQ at its delivery limit, replayed from there) would make
    // RabbitMQ take that hop for a cycle and hold or drop the retry.
    let props = if matches!(
        item.disposition,
        Disposition::Retry { .. } | Disposition::Defer { .. }
    ) {
        without(props, DEATH_HISTORY)
    } else {
        props
    };
    let props = add_header(
        props,
        "x-dead-letter-consumer",
        AMQPValue::LongString(consumer.into()),
    )
    .with_delivery_mode(wire::DELIVERY_MODE_PERSISTENT);
    Some((target, props))
}

/// Awaits every copy's confirm against one deadline (moved past a block
/// of `conn`): a copy refused, returned or unconfirmed fails the batch's
/// ack.
async fn await_confirms(
    conn: &Connection,
    pending: Vec<(&String, PublisherConfirm)>,
    timeout: Duration,
) -> Result<()> {
    let mut deadline = tokio::time::Instant::now() + timeout;
    for (target, confirm) in pending {
        let mut confirm = std::pin::pin!(confirm);
        let confirmation = loop {
            match tokio::time::timeout_at(deadline, confirm.as_mut()).await {
                Err(_) if is_blocked(conn) => {
                    while_blocked(conn).await;
                    deadline = tokio::time::Instant::now() + timeout;
                }
                Err(_) => {
                    return Err(Error::Broker(BrokerError::TimedOut {
                        what: "publisher confirm",
                        timeout,
                    }));
                }
                Ok(r) => {
                    break r.map_err(|source| {
                        Error::Broker(BrokerError::Failed {
                            what: "publisher confirm",
                            source,
                        })
                    })?;
                }
            }
        };
        match confirmation {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)) => {
                return Err(Error::Returned {
                    queue: target.clone(),
                    code: ret.reply_code,
                    text: ret.reply_text.to_string(),
                });
            }
            Confirmation::Nack(None) | Confirmation::NotRequested => {
                return Err(Error::Nacked {
                    queue: target.clone(),
                });
            }
        }
    }
    Ok(())
}

fn with_header(props: &BasicProperties, name: &str, value: AMQPValue) -> BasicProperties {
    add_header(props.clone(), name, value)
}

fn add_header(props: BasicProperties, name: &str, value: AMQPValue) -> BasicProperties {
    // The broker's count belongs to this delivery, not to the copy.
    let props = without(props, &[HEADER_DELIVERY_COUNT]);
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), value);
    props.with_headers(headers)
}

/// `props` without the headers `names`.
fn without(props: BasicProperties, names: &[&str]) -> BasicProperties {
    match props.headers() {
        Some(h) if names.iter().any(|n| h.contains_key(n)) => {
            let mut map = h.inner().clone();
            for n in names {
                map.remove(*n);
            }
            props.with_headers(map.into())
        }
        _ => props,
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::FieldTable;

    use super::*;

    #[test]
    fn copies_drop_the_brokers_counts_and_retries_their_death_history() {
        let mut h = FieldTable::default();
        for name in [
            "x-death",
            "x-last-death-queue",
            HEADER_DELIVERY_COUNT,
            "x-aggregate-id",
        ] {
            h.insert(name.into(), AMQPValue::LongString("v".into()));
        }
        let props = BasicProperties::default().with_headers(h);
        let copy = add_header(props.clone(), "x-retry-count", AMQPValue::LongLongInt(1));
        let names = |p: &BasicProperties| -> Vec<String> {
            p.headers()
                .clone()
                .unwrap_or_default()
                .inner()
                .keys()
                .map(|k| k.to_string())
                .collect()
        };
        assert_eq!(
            names(&copy),
            [
                "x-aggregate-id",
                "x-death",
                "x-last-death-queue",
                "x-retry-count"
            ]
        );
        assert_eq!(
            names(&without(copy, DEATH_HISTORY)),
            ["x-aggregate-id", "x-retry-count"]
        );
    }
}
