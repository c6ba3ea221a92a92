//! What is on the wire: an audit queue the demo reads itself (every
//! message the relay published, with duplicates), and the injection of
//! duplicate deliveries straight into the consumers' queues; both through
//! any node of a cluster.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection};
use outbox_core::backoff::Backoff;
use outbox_core::outage::Outage;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::broker::{Broker, bounded};
use crate::env::AUDIT_QUEUE;

/// Keep one message in this many as a candidate for re-injection.
const SAMPLE_EVERY: usize = 5;

/// A published message, kept to be sent again.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    properties: BasicProperties,
    body: Vec<u8>,
}

/// Everything the audit queue received.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    seen: Mutex<HashMap<String, u32>>,
    samples: Mutex<Vec<Sample>>,
    deliveries: AtomicU64,
    /// Signalled on every delivery: the relay is busy publishing.
    pub(crate) activity: Notify,
}

impl Wire {
    /// Messages received, duplicates included.
    pub(crate) fn deliveries(&self) -> u64 {
        self.deliveries.load(Ordering::SeqCst)
    }

    /// Distinct message ids received.
    pub(crate) fn distinct(&self) -> u64 {
        self.seen.lock().unwrap().len() as u64
    }

    /// The distinct message ids received.
    pub(crate) fn ids(&self) -> HashSet<String> {
        self.seen.lock().unwrap().keys().cloned().collect()
    }

    /// Takes up to `n` of the kept messages, oldest first.
    pub(crate) fn take_samples(&self, n: usize) -> Vec<Sample> {
        let mut samples = self.samples.lock().unwrap();
        let n = n.min(samples.len());
        samples.drain(..n).collect()
    }

    /// Counts a delivery of the audit queue. One the queue delivers again
    /// (`redelivered`: the demo lost its connection before its ack) counts
    /// only if its id is new: it was not a copy the relay published.
    fn record(&self, properties: BasicProperties, body: Vec<u8>, redelivered: bool) {
        let id = properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let first = {
            let mut seen = self.seen.lock().unwrap();
            if redelivered && seen.contains_key(&id) {
                return;
            }
            let count = seen.entry(id).or_default();
            *count += 1;
            *count == 1
        };
        let n = self.deliveries.fetch_add(1, Ordering::SeqCst) as usize;
        if first && n.is_multiple_of(SAMPLE_EVERY) {
            self.samples
                .lock()
                .unwrap()
                .push(Sample { properties, body });
        }
        self.activity.notify_waiters();
    }
}

/// Reads the audit queue into `wire` until aborted, reconnecting (to
/// another node of a cluster) whenever its connection is lost.
pub(crate) fn tap(broker: Arc<Broker>, wire: Arc<Wire>) -> JoinHandle<()> {
    tokio::spawn(async move {
        // One warning when the broker goes, as the relay and consumers log.
        let outage = Outage::new("broker", "demo audit queue");
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            if let Err(e) = tap_once(&broker, &wire, &outage, &mut backoff).await {
                outage.failed(&*e);
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    })
}

/// One connection's reading of the audit queue.
async fn tap_once(
    broker: &Broker,
    wire: &Wire,
    outage: &Outage,
    backoff: &mut Backoff,
) -> Result<()> {
    let conn = broker.connect().await?;
    let result = read_audit(&conn, wire, outage, backoff).await;
    let _ = bounded("connection close", conn.close(200, "audit".into())).await;
    result
}

/// Records and acks the audit queue's deliveries until the connection is
/// lost. lapin may not wake a consumer whose node was killed: the
/// connection is looked at every second.
async fn read_audit(
    conn: &Connection,
    wire: &Wire,
    outage: &Outage,
    backoff: &mut Backoff,
) -> Result<()> {
    let ch = bounded("channel open", conn.create_channel()).await?;
    let consume = ch.basic_consume(
        AUDIT_QUEUE.into(),
        "demo-audit".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    );
    let mut deliveries = bounded("basic.consume", consume)
        .await
        .context("consuming the audit queue")?;
    outage.ok();
    backoff.reset();
    loop {
        let d = tokio::select! {
            d = deliveries.next() => match d {
                Some(d) => d?,
                None => bail!("the broker cancelled the audit queue's consumer"),
            },
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                ensure!(
                    conn.status().connected() && ch.status().connected(),
                    "the audit queue's connection was lost"
                );
                continue;
            }
        };
        // Recorded, then acked: a copy whose ack was lost comes back.
        let acker = d.acker.clone();
        wire.record(d.properties, d.data, d.redelivered);
        bounded("basic.ack", acker.ack(BasicAckOptions::default())).await?;
    }
}

/// Publishes each sample `copies` times, back to back, straight to each of
/// `queues` (default exchange), with its original properties and so its
/// original `message_id`: to a consumer it is a duplicate delivery.
/// Returns how many messages each queue received (at least: when a node is
/// lost half-way, every copy is sent again on another).
pub(crate) async fn inject(
    broker: &Broker,
    samples: &[Sample],
    queues: &[&str],
    copies: usize,
) -> Result<u64> {
    broker
        .run(async |conn| publish_copies(conn, samples, queues, copies).await)
        .await?;
    Ok((samples.len() * copies) as u64)
}

async fn publish_copies(
    conn: &Connection,
    samples: &[Sample],
    queues: &[&str],
    copies: usize,
) -> Result<()> {
    let ch = bounded("channel open", conn.create_channel()).await?;
    bounded(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    let mut pending = Vec::new();
    for sample in samples {
        for queue in queues {
            for _ in 0..copies {
                let publish = ch.basic_publish(
                    "".into(),
                    (*queue).into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &sample.body,
                    sample.properties.clone(),
                );
                pending.push(bounded("basic.publish", publish).await?);
            }
        }
    }
    for confirm in pending {
        let confirmation = bounded("publisher confirm", confirm).await?;
        ensure!(
            matches!(confirmation, Confirmation::Ack(None)),
            "an injected duplicate was not accepted: {confirmation:?}"
        );
    }
    let _ = bounded("channel close", ch.close(200, "injected".into())).await;
    Ok(())
}
