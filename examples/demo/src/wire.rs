//! What is on the wire: an audit queue the demo reads itself (every
//! message the relay published, with duplicates), and the injection of
//! duplicate deliveries straight into the consumers' queues.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, ensure};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

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

    fn record(&self, properties: BasicProperties, body: Vec<u8>) {
        let id = properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let first = {
            let mut seen = self.seen.lock().unwrap();
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

/// Reads the audit queue into `wire` until the connection closes.
pub(crate) async fn tap(conn: &Connection, wire: std::sync::Arc<Wire>) -> Result<JoinHandle<()>> {
    let ch = conn.create_channel().await?;
    let mut deliveries = ch
        .basic_consume(
            AUDIT_QUEUE.into(),
            "demo-audit".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .context("consuming the audit queue")?;
    Ok(tokio::spawn(async move {
        while let Some(Ok(d)) = deliveries.next().await {
            let _ = d.acker.ack(BasicAckOptions::default()).await;
            wire.record(d.properties, d.data);
        }
    }))
}

/// Publishes each sample `copies` times, back to back, straight to each of
/// `queues` (default exchange), with its original properties and so its
/// original `message_id`: to a consumer it is a duplicate delivery.
/// Returns how many messages each queue received.
pub(crate) async fn inject(
    conn: &Connection,
    samples: &[Sample],
    queues: &[&str],
    copies: usize,
) -> Result<u64> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = Vec::new();
    for sample in samples {
        for queue in queues {
            for _ in 0..copies {
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        (*queue).into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &sample.body,
                        sample.properties.clone(),
                    )
                    .await?;
                pending.push(confirm);
            }
        }
    }
    for confirm in pending {
        let confirmation = confirm.await?;
        ensure!(
            matches!(confirmation, Confirmation::Ack(None)),
            "an injected duplicate was not accepted: {confirmation:?}"
        );
    }
    let _ = ch.close(200, "injected".into()).await;
    Ok((samples.len() * copies) as u64)
}
