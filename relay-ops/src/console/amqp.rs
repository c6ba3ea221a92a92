//! The console's broker side: one connection, opened on first use and
//! again after it fails; queue depths from passive declares; a consumer's
//! dead-letter queue read without losing, looping or reordering a message;
//! and publishing with confirms.
//!
//! Reading a queue over AMQP takes its messages: the console holds them
//! unacknowledged, reads them, and gives them back with one
//! `basic.nack(multiple, requeue)`, which puts them back where they were.
//! On a quorum queue every give-back counts toward the queue's delivery
//! limit (RabbitMQ 4.0 to 4.2 count `basic.nack` too, and apply a default
//! limit of 20 with no dead-letter target: the 21st read would drop the
//! message). So when a message read from a queue it held whole has been
//! given back [`RENEW_AT`] times, the console renews the queue instead: it
//! publishes a copy of every message, in order and confirmed, behind them,
//! then acks the originals; the queue holds the same messages in the same
//! order, each counted from zero.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use outbox::redact::SecretUrl;
use outbox::wire;
use outbox_core::amqp::{bounded, connect_any};

/// A message read this many times (its `x-delivery-count`) is renewed
/// when the whole queue is held: well below RabbitMQ 4's default limit of
/// 20, so a limit of 11 or more never drops a browsed message.
pub(crate) const RENEW_AT: i64 = 10;

/// Headers the consumer adds on the way to a dead-letter queue, besides
/// the broker's death history (`outbox_core::queues::DEATH_HISTORY`): a
/// replayed copy carries none of them, so it starts afresh (no retry count
/// spent, no death history RabbitMQ could take for a cycle).
const DEAD_LETTER_HEADERS: &[&str] = &[
    "x-delivery-count",
    "x-dead-letter-consumer",
    wire::HEADER_DEAD_LETTER_REASON,
    wire::HEADER_RETRY_COUNT,
    "x-deferral-count",
];

/// The broker the console reads, at the first of its URLs that answers.
pub(crate) struct Broker {
    urls: SecretUrl,
    timeout: Duration,
    conn: tokio::sync::Mutex<Option<Connection>>,
}

impl Broker {
    pub(crate) fn new(urls: SecretUrl, timeout: Duration) -> Broker {
        Broker {
            urls,
            timeout,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A new channel in confirm mode, on the shared connection (opened
    /// again when it has failed).
    pub(crate) async fn channel(&self) -> Result<Channel> {
        let ch = self.reading_channel().await?;
        bounded(
            "confirm.select",
            self.timeout,
            ch.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(ch)
    }

    /// A new channel that does not publish (no confirm mode: one round
    /// trip less), on the shared connection.
    async fn reading_channel(&self) -> Result<Channel> {
        let t = self.timeout;
        let mut conn = self.conn.lock().await;
        if !conn.as_ref().is_some_and(|c| c.status().connected()) {
            let urls = outbox::urls::split_urls(self.urls.expose());
            let props =
                ConnectionProperties::default().with_connection_name("outbox-console".into());
            let (c, _, _) = connect_any(&urls, 0, t, props).await?;
            *conn = Some(c);
        }
        let c = conn.as_ref().context("no broker connection")?;
        let ch = bounded("channel open", t, c.create_channel()).await?;
        drop(conn);
        Ok(ch)
    }

    /// Ready messages and consumers of `queue`; `None` when it does not
    /// exist.
    pub(crate) async fn depth(&self, queue: &str) -> Result<Option<(u32, u32)>> {
        let ch = self.reading_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let got = bounded(
            "queue.declare (passive)",
            self.timeout,
            ch.queue_declare(queue.into(), passive, FieldTable::default()),
        )
        .await;
        match got {
            Ok(q) => {
                close(&ch, self.timeout).await;
                Ok(Some((q.message_count(), q.consumer_count())))
            }
            // 404 closes the channel: the queue is not there.
            Err(e) if e.to_string().contains("NOT_FOUND") => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Holds up to `max` messages of `queue`, from its head, unacked on a
    /// channel of their own, to read them and give them back
    /// ([`Held::release`]). An empty queue holds nothing; a missing one is
    /// an error.
    pub(crate) async fn hold(&self, queue: &str, max: u16) -> Result<Held> {
        let ch = self.reading_channel().await?;
        Held::take_from(ch, queue, max, self.timeout).await
    }

    /// Holds them as [`Broker::hold`] does, on a channel in confirm mode,
    /// to move some ([`Held::settle`]).
    pub(crate) async fn hold_to_move(&self, queue: &str, max: u16) -> Result<Held> {
        let ch = self.channel().await?;
        Held::take_from(ch, queue, max, self.timeout).await
    }
}

impl Held {
    async fn take_from(ch: Channel, queue: &str, max: u16, timeout: Duration) -> Result<Held> {
        let mut held = Held {
            ch,
            queue: queue.to_owned(),
            messages: Vec::new(),
            whole: true,
            timeout,
        };
        held.take(max).await?;
        Ok(held)
    }
}

async fn close(ch: &Channel, t: Duration) {
    let _ = tokio::time::timeout(t, ch.close(200, "OK".into())).await;
}

/// A dead-lettered message as the pages show it.
#[derive(Debug)]
pub(crate) struct DeadLetter {
    tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
    /// The event id (`message_id`), when it has one.
    pub(crate) message_id: Option<String>,
    pub(crate) event_type: String,
    /// Why: the consumer's `x-dead-letter-reason`, else the broker's
    /// (`x-first-death-reason`: `delivery_limit`, `rejected`, `expired`,
    /// `maxlen`) and the queue it left.
    pub(crate) reason: String,
    /// The consumer that dead-lettered it (`x-dead-letter-consumer`).
    pub(crate) consumer: String,
    /// How often it was given back already (`x-delivery-count`).
    pub(crate) delivery_count: i64,
    pub(crate) body_text: String,
}

fn header_text(h: Option<&FieldTable>, name: &str) -> Option<String> {
    match h?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        _ => None,
    }
}

impl DeadLetter {
    fn of(d: lapin::message::Delivery) -> DeadLetter {
        let p = &d.properties;
        let h = p.headers().as_ref();
        let broker = header_text(h, "x-first-death-reason").map(|r| {
            let from = header_text(h, "x-first-death-queue").unwrap_or_default();
            format!("x-death: {r} (from {from})")
        });
        let reason = match (header_text(h, wire::HEADER_DEAD_LETTER_REASON), broker) {
            (Some(c), Some(b)) => format!("{c}; {b}"),
            (Some(r), None) | (None, Some(r)) => r,
            (None, None) => "(no reason recorded)".to_owned(),
        };
        let body_text = String::from_utf8_lossy(&d.data).chars().take(300).collect();
        DeadLetter {
            tag: d.delivery_tag,
            message_id: p.message_id().as_ref().map(|m| m.to_string()),
            event_type: p.kind().as_ref().map(|k| k.to_string()).unwrap_or_default(),
            reason,
            consumer: header_text(h, "x-dead-letter-consumer").unwrap_or_default(),
            delivery_count: header_text(h, "x-delivery-count")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
            properties: p.clone(),
            body: d.data,
            body_text,
        }
    }

    /// The properties of a fresh copy: the dead-letter headers removed.
    fn fresh_properties(&self) -> BasicProperties {
        let Some(h) = self.properties.headers() else {
            return self.properties.clone();
        };
        let mut map = h.inner().clone();
        for n in outbox_core::queues::DEATH_HISTORY
            .iter()
            .chain(DEAD_LETTER_HEADERS)
        {
            map.remove(*n);
        }
        self.properties.clone().with_headers(map.into())
    }
}

/// Messages held unacked on a channel: give them back
/// ([`Held::release`]) or settle some ([`Held::settle`]). Dropping it
/// closes the channel, which gives them back too.
pub(crate) struct Held {
    ch: Channel,
    queue: String,
    pub(crate) messages: Vec<DeadLetter>,
    /// Whether every ready message of the queue is held.
    pub(crate) whole: bool,
    timeout: Duration,
}

impl Held {
    /// Takes up to `max` messages: the first with `basic.get`, which says
    /// exactly how many are left behind it (a passive declare's count of a
    /// quorum queue lags); the rest through a consumer with that prefetch,
    /// cancelled once they arrived, its stream drained.
    async fn take(&mut self, max: u16) -> Result<()> {
        let t = self.timeout;
        let get = self
            .ch
            .basic_get(self.queue.as_str().into(), BasicGetOptions::default());
        let Some(first) = bounded("basic.get", t, get).await? else {
            return Ok(());
        };
        let left = first.message_count;
        self.messages.push(DeadLetter::of(first.delivery));
        let want = left.min(u32::from(max.saturating_sub(1))) as u16;
        self.whole = left <= u32::from(want);
        if want == 0 {
            return Ok(());
        }
        bounded(
            "basic.qos",
            t,
            self.ch.basic_qos(want, BasicQosOptions::default()),
        )
        .await?;
        let tag = format!("outbox-console-{}", uuid::Uuid::new_v4().simple());
        let consume = self.ch.basic_consume(
            self.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let mut stream = bounded("basic.consume", t, consume).await?;
        // Another reader may take some meanwhile: stop when none comes.
        let pause = Duration::from_secs(1).min(t);
        while self.messages.len() <= usize::from(want) {
            match tokio::time::timeout(pause, stream.next()).await {
                Ok(Some(d)) => self.messages.push(DeadLetter::of(d?)),
                Ok(None) | Err(_) => break,
            }
        }
        let cancel = self
            .ch
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default());
        bounded("basic.cancel", t, cancel).await?;
        // Deliveries sent before the cancel arrived end the stream.
        while let Ok(Some(d)) = tokio::time::timeout(t, stream.next()).await {
            self.messages.push(DeadLetter::of(d?));
        }
        Ok(())
    }

    fn last_tag(&self) -> Option<u64> {
        self.messages.iter().map(|m| m.tag).max()
    }

    /// The tag one `basic.nack(multiple)` gives back every message still
    /// held with, once those at `settled` were acked: the highest tag not
    /// settled. Not the last tag when that one was acked: RabbitMQ refuses
    /// a tag it no longer holds ("unknown delivery tag") and closes the
    /// channel, and that close crossing the console's own poisoned the
    /// connection every page shared (the browse after a renewal failed).
    fn requeue_tag(&self, settled: &[usize]) -> Option<u64> {
        requeue_tag(self.messages.iter().map(|m| m.tag), settled)
    }

    /// Gives every held message back, in place; renews the queue instead
    /// when it is held whole and a message is near the delivery limit.
    /// Returns whether it renewed.
    pub(crate) async fn release(self) -> Result<bool> {
        let renew = self.whole && self.messages.iter().any(|m| m.delivery_count >= RENEW_AT);
        if renew {
            // Held to read: the copies need confirms.
            let select = self.ch.confirm_select(ConfirmSelectOptions::default());
            bounded("confirm.select", self.timeout, select).await?;
            let all: Vec<usize> = (0..self.messages.len()).collect();
            let queue = self.queue.clone();
            self.settle(&all, Some(&queue)).await?;
            return Ok(true);
        }
        self.requeue_rest(&[]).await?;
        close(&self.ch, self.timeout).await;
        Ok(false)
    }

    /// Gives back every held message not at `settled`, then makes sure the
    /// broker took the acks and the nack: they have no reply of their own,
    /// so a `basic.qos` behind them on the channel fails with the channel's
    /// error if the broker refused one.
    async fn requeue_rest(&self, settled: &[usize]) -> Result<()> {
        if let Some(tag) = self.requeue_tag(settled) {
            let nack = BasicNackOptions {
                multiple: true,
                requeue: true,
            };
            bounded("basic.nack", self.timeout, self.ch.basic_nack(tag, nack)).await?;
        }
        let check = self.ch.basic_qos(0, BasicQosOptions::default());
        bounded("basic.qos (settlement check)", self.timeout, check).await?;
        Ok(())
    }

    /// Settles the messages at `chosen`: with `copy_to`, publishes a fresh
    /// copy of each to that queue first (in order, confirmed; any copy not
    /// confirmed and nothing is acked); then acks them, and gives the rest
    /// back in place. At least once: a crash between the confirms and the
    /// acks leaves both copies.
    pub(crate) async fn settle(self, chosen: &[usize], copy_to: Option<&str>) -> Result<usize> {
        if let Some(queue) = copy_to {
            let copies = chosen.iter().map(|&i| {
                let m = &self.messages[i];
                (m.fresh_properties(), m.body.as_slice())
            });
            if let Err(e) = publish(&self.ch, queue, copies, self.timeout).await {
                let _ = self.requeue_rest(&[]).await;
                close(&self.ch, self.timeout).await;
                return Err(e);
            }
        }
        if chosen.len() == self.messages.len() {
            // All of them (a renewal, "all matching"): one ack.
            if let Some(last) = self.last_tag() {
                let all = BasicAckOptions { multiple: true };
                bounded("basic.ack", self.timeout, self.ch.basic_ack(last, all)).await?;
            }
        } else {
            let acks = chosen.iter().map(|&i| {
                let ack = self
                    .ch
                    .basic_ack(self.messages[i].tag, BasicAckOptions::default());
                bounded("basic.ack", self.timeout, ack)
            });
            futures_util::future::try_join_all(acks).await?;
        }
        self.requeue_rest(chosen).await?;
        close(&self.ch, self.timeout).await;
        Ok(chosen.len())
    }
}

/// The highest of `tags` whose index is not in `settled`.
fn requeue_tag(tags: impl Iterator<Item = u64>, settled: &[usize]) -> Option<u64> {
    let settled: std::collections::HashSet<usize> = settled.iter().copied().collect();
    tags.enumerate()
        .filter(|(i, _)| !settled.contains(i))
        .map(|(_, t)| t)
        .max()
}

/// Publishes each (properties, body) to `queue` through the default
/// exchange, mandatory, then awaits every confirm against one deadline. A
/// nack, a returned message (no such queue) or a missing confirm fails.
pub(crate) async fn publish<'a>(
    ch: &Channel,
    queue: &str,
    messages: impl Iterator<Item = (BasicProperties, &'a [u8])>,
    t: Duration,
) -> Result<usize> {
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let mut pending = Vec::new();
    for (props, body) in messages {
        let sent = ch.basic_publish("".into(), queue.into(), opts, body, props);
        pending.push(bounded("basic.publish", t, sent).await?);
    }
    let deadline = tokio::time::Instant::now() + t;
    let n = pending.len();
    for confirm in pending {
        let got = tokio::time::timeout_at(deadline, confirm)
            .await
            .with_context(|| format!("the broker did not confirm within {t:?}"))??;
        match got {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)) => {
                bail!(
                    "returned by the broker: {} {} (is there a queue {queue:?}?)",
                    r.reply_code,
                    r.reply_text
                )
            }
            Confirmation::Nack(None) | Confirmation::NotRequested => {
                bail!("nacked by the broker (queue {queue:?} full or unavailable?)")
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::requeue_tag;

    #[test]
    fn the_nack_gives_back_up_to_the_highest_tag_still_held() {
        let tags = || [4_u64, 5, 6, 7].into_iter();
        assert_eq!(requeue_tag(tags(), &[]), Some(7), "nothing settled");
        assert_eq!(requeue_tag(tags(), &[1]), Some(7), "a middle one acked");
        assert_eq!(requeue_tag(tags(), &[3]), Some(6), "the last one acked");
        assert_eq!(requeue_tag(tags(), &[2, 3]), Some(5));
        assert_eq!(requeue_tag(tags(), &[0, 1, 2, 3]), None, "all acked");
        assert_eq!(requeue_tag(std::iter::empty(), &[]), None);
    }
}
