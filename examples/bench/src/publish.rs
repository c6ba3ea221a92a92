//! The raw confirmed publisher: the ceiling of the relay's drain, also
//! used to preload the consumer's queues.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use lapin::options::BasicPublishOptions;
use lapin::{Confirmation, Connection};
use tokio::sync::Barrier;

use crate::common::*;

/// How the raw publisher spreads its confirms: `channels` tasks, each on
/// its own confirm-mode channel, each keeping up to `window` publishes
/// unconfirmed (a sliding window: a new publish as soon as the oldest
/// confirm arrives, never stop-and-wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PublishTuning {
    pub(crate) channels: usize,
    pub(crate) window: usize,
}

impl fmt::Display for PublishTuning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} channel(s) x sliding window {}",
            self.channels, self.window
        )
    }
}

/// What the sweep tries; the best one is the ceiling.
pub(crate) const PUBLISH_SWEEP: [PublishTuning; 6] = [
    PublishTuning {
        channels: 1,
        window: 500,
    },
    PublishTuning {
        channels: 1,
        window: 2000,
    },
    PublishTuning {
        channels: 2,
        window: 500,
    },
    PublishTuning {
        channels: 2,
        window: 2000,
    },
    PublishTuning {
        channels: 4,
        window: 256,
    },
    PublishTuning {
        channels: 4,
        window: 1000,
    },
];

/// Publishes `n` persistent messages with the relay's properties and
/// payload size to `exchange` (routing key `routing_key`, `mandatory` like
/// the relay), every confirm awaited and checked; returns the seconds the
/// publishing took, from the moment every task is ready.
pub(crate) async fn publish(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
    n: usize,
    tuning: PublishTuning,
) -> Result<f64> {
    let channels = tuning.channels.max(1);
    let window = tuning.window.max(1);
    let body = Arc::new(serde_json::to_vec(&payload())?);
    let props = relay_properties()?;
    let start = Arc::new(Barrier::new(channels + 1));
    let mut tasks = Vec::new();
    for c in 0..channels {
        let ch = confirm_channel(conn).await?;
        let share = n / channels + usize::from(c < n % channels);
        let (body, props, start) = (body.clone(), props.clone(), start.clone());
        let (exchange, routing_key) = (exchange.to_owned(), routing_key.to_owned());
        tasks.push(tokio::spawn(async move {
            let opts = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            let mut pending = VecDeque::with_capacity(window);
            // Published a group at a time (half the window), so a group's
            // writes are awaited together while the rest of the window is
            // on the wire.
            let group = window.div_ceil(2);
            start.wait().await;
            let mut left = share;
            while left > 0 {
                let g = group.min(left);
                while pending.len() + g > window
                    && let Some(oldest) = pending.pop_front()
                {
                    check(oldest).await?;
                }
                let publishes = (0..g)
                    .map(|_| {
                        let props = props
                            .clone()
                            .with_message_id(uuid::Uuid::now_v7().to_string().into());
                        ch.basic_publish(
                            exchange.as_str().into(),
                            routing_key.as_str().into(),
                            opts,
                            &body,
                            props,
                        )
                    })
                    .collect();
                let confirms = queue_all(publishes).await?;
                pending.extend(confirms);
                left -= g;
            }
            for confirm in pending {
                check(confirm).await?;
            }
            let _ = ch.close(200, "done".into()).await;
            Ok::<_, anyhow::Error>(())
        }));
    }
    start.wait().await;
    let started = Instant::now();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn check(confirm: lapin::PublisherConfirm) -> Result<()> {
    let c = confirm.await?;
    anyhow::ensure!(c == Confirmation::Ack(None), "raw publish not acked: {c:?}");
    Ok(())
}

/// Raw confirmed publishes per second of `n` messages into a fresh durable
/// queue (the relay's kind of queue), after a warm-up of `n / 10` that is
/// not timed. Returns (rate, CPU seconds of broker, database, this process).
pub(crate) async fn raw_publish_rate(
    url: &str,
    n: usize,
    tuning: PublishTuning,
) -> Result<(f64, (f64, f64, f64))> {
    let conn = connect(url).await?;
    let name = format!("bench.raw.{}", suffix());
    topology(&conn, &name).await?;
    publish(&conn, &name, "order.OrderPlaced", (n / 10).max(1), tuning).await?;
    let cpu = CpuSpan::start(std::process::id());
    let secs = publish(&conn, &name, "order.OrderPlaced", n, tuning).await?;
    let cpu = cpu.stop();
    drop_queue(&conn, &name).await?;
    let _ = conn.close(200, "done".into()).await;
    Ok((n as f64 / secs, cpu))
}
