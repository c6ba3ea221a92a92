//! Background consumers that record what reaches a queue: [`Collector`]
//! (by message id) and [`SeqLog`] (by aggregate sequence).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::watch;

use crate::{amqp_url, connect_any, depth, settled_depth, wait_until, wait_until_every};

/// What a [`Collector`] received, keyed by message id.
#[derive(Debug, Default)]
pub struct Received {
    /// Deliveries per message id (more than one: a duplicate on the wire).
    pub counts: HashMap<String, usize>,
    /// The first delivery of each message id.
    pub first: HashMap<String, lapin::message::Delivery>,
    /// When each delivery arrived, in order.
    pub arrivals: Vec<Instant>,
}

impl Received {
    /// Duplicates seen on the wire.
    pub fn duplicates(&self) -> usize {
        self.counts.values().map(|c| c - 1).sum()
    }

    /// The longest time between two deliveries that arrived within
    /// `from..to` (including the time from `from` to the first one).
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut last = from;
        let mut longest = Duration::ZERO;
        for &at in self.arrivals.iter().filter(|&&a| a >= from && a <= to) {
            longest = longest.max(at - last);
            last = at;
        }
        longest
    }
}

type Record = Arc<dyn Fn(lapin::message::Delivery) + Send + Sync>;
type Stopper = (watch::Sender<bool>, tokio::task::JoinHandle<()>);

/// A background consumer of one queue that hands every delivery to a
/// recorder before acking it, reconnects by itself (for broker-restart
/// tests), and can drain its queue before a test judges.
#[derive(Clone)]
struct Tap {
    /// Broker URLs, comma-separated, tried in turn.
    urls: String,
    queue: String,
    record: Record,
    task: Arc<Mutex<Option<Stopper>>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("queue", &self.queue).finish()
    }
}

impl Tap {
    fn start(urls: &str, queue: &str, record: Record) -> Self {
        let t = Self {
            urls: urls.to_owned(),
            queue: queue.to_owned(),
            record,
            task: Arc::new(Mutex::new(None)),
        };
        t.resume();
        t
    }

    fn resume(&self) {
        let (stop, mut stopped) = watch::channel(false);
        let (urls, queue, record) = (self.urls.clone(), self.queue.clone(), self.record.clone());
        let task = tokio::spawn(async move {
            while !*stopped.borrow() {
                let _ = tap(&urls, &queue, &record, &mut stopped).await;
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        });
        *self.task.lock().unwrap() = Some((stop, task));
    }

    fn abort(&self) {
        if let Some((_, t)) = self.task.lock().unwrap().take() {
            t.abort();
        }
    }

    /// Stops consuming between two messages and waits until its
    /// connection is gone.
    async fn finish(&self) {
        let taken = self.task.lock().unwrap().take();
        if let Some((stop, task)) = taken {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }

    /// Consumes until the queue holds nothing: no ready message once the
    /// tap has stopped, and none that `uncounted` reports (what a passive
    /// declare leaves out, such as a quorum queue's messages still checked
    /// out to a consumer of a killed node).
    async fn drain<F, Fut>(&self, timeout: Duration, uncounted: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = u64>,
    {
        let conn = connect_any(&self.urls)
            .await
            .expect("a broker of the tap reachable");
        if self.task.lock().unwrap().is_none() {
            // Drained before, or stopped: consume again.
            self.resume();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            wait_until(left, &format!("{} to empty", self.queue), || async {
                depth(&conn, &self.queue).await.0 == 0
            })
            .await;
            self.finish().await;
            if settled_depth(&conn, &self.queue, deadline).await == 0 {
                let n = uncounted().await;
                if n == 0 {
                    break;
                }
                eprintln!(
                    "{}: {n} messages a passive declare did not count; draining again",
                    self.queue
                );
                // The tap consumes them as the queue gives them back.
                self.resume();
                let left = deadline.saturating_duration_since(Instant::now());
                // A count may run `rabbitmqctl`: once a second.
                wait_until_every(
                    left,
                    Duration::from_secs(1),
                    &format!("{} to give back what it held", self.queue),
                    || async { uncounted().await == 0 },
                )
                .await;
                continue;
            }
            // A message delivered but not yet recorded went back: again.
            self.resume();
        }
        let _ = conn.close(200, "ok".into()).await;
    }
}

async fn tap(
    urls: &str,
    queue: &str,
    record: &Record,
    stopped: &mut watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // Every broker await is bounded, and a lost connection is noticed
    // within a second: lapin may not wake a consumer whose node was
    // SIGKILLed or stopped, and a tap stuck on a dead connection would
    // leave its queue undrained (seen once in the cluster suite).
    let t = Duration::from_secs(5);
    let conn = connect_any(urls).await?;
    let ch = tokio::time::timeout(t, conn.create_channel()).await??;
    tokio::time::timeout(t, ch.basic_qos(500, Default::default())).await??;
    let mut consumer = tokio::time::timeout(
        t,
        ch.basic_consume(
            queue.into(),
            "tap".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await??;
    let result = loop {
        // Stops only between messages: a recorded message is always acked
        // (or its connection is lost, and its redelivery is a real copy).
        let d = tokio::select! {
            _ = stopped.changed() => break Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if conn.status().connected() && ch.status().connected() {
                    continue;
                }
                break Err(anyhow::anyhow!("tap connection lost"));
            }
            d = consumer.next() => match d {
                Some(Ok(d)) => d,
                Some(Err(e)) => break Err(e.into()),
                None => break Ok(()),
            },
        };
        let acker = d.acker.clone();
        record(d);
        match tokio::time::timeout(t, acker.ack(BasicAckOptions::default())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => break Err(e.into()),
            Err(e) => break Err(e.into()),
        }
    };
    let _ = tokio::time::timeout(t, conn.close(200, "ok".into())).await;
    result
}

/// Consumes a queue in the background, recording every message by its
/// message id.
#[derive(Debug, Clone)]
pub struct Collector {
    /// What arrived so far.
    pub received: Arc<Mutex<Received>>,
    tap: Tap,
}

impl Collector {
    /// Starts consuming `queue`.
    pub fn start(queue: &str) -> Self {
        Self::start_on(&amqp_url(), queue)
    }

    /// Starts consuming `queue` on the first of `urls` (comma-separated)
    /// that answers, reconnecting through them.
    pub fn start_on(urls: &str, queue: &str) -> Self {
        let received = Arc::new(Mutex::new(Received::default()));
        let r = received.clone();
        let record: Record = Arc::new(move |d: lapin::message::Delivery| {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let mut g = r.lock().unwrap();
            g.arrivals.push(Instant::now());
            *g.counts.entry(id.clone()).or_default() += 1;
            g.first.entry(id).or_insert(d);
        });
        Self {
            received,
            tap: Tap::start(urls, queue, record),
        }
    }

    /// Distinct message ids received.
    pub fn distinct(&self) -> usize {
        self.received.lock().unwrap().counts.len()
    }

    /// Whether `id` arrived.
    pub fn has(&self, id: &str) -> bool {
        self.received.lock().unwrap().counts.contains_key(id)
    }

    /// Duplicates seen so far.
    pub fn duplicates(&self) -> usize {
        self.received.lock().unwrap().duplicates()
    }

    /// Stops consuming at once (what it holds unacked goes back to the
    /// queue).
    pub fn stop(&self) {
        self.tap.abort();
    }

    /// Quiet before judging: consumes the queue until it holds no message,
    /// ready or unacknowledged, then stops. Call it once every publisher
    /// has stopped (a stopped relay's late copies included).
    pub async fn drain(&self, timeout: Duration) {
        self.tap.drain(timeout, || async { 0 }).await;
    }

    /// [`Collector::drain`] for a queue a passive declare may not count
    /// whole (a quorum queue on a cluster whose nodes were killed): it
    /// drains again until `uncounted` also reports none left.
    pub async fn drain_counting<F, Fut>(&self, timeout: Duration, uncounted: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = u64>,
    {
        self.tap.drain(timeout, uncounted).await;
    }
}

/// Every delivery of a queue as (`x-aggregate-id`, `x-aggregate-seq`), in
/// arrival order, copies included; seq 0 for an event without a sequence.
/// Consumes and acks in the background.
#[derive(Debug, Clone)]
pub struct SeqLog {
    entries: Arc<Mutex<Vec<(String, i64)>>>,
    tap: Tap,
}

impl SeqLog {
    /// Starts consuming `queue` (which must exist).
    pub fn start(queue: &str) -> Self {
        let entries: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
        let e = entries.clone();
        let record: Record = Arc::new(move |d: lapin::message::Delivery| {
            let headers = d.properties.headers().clone().unwrap_or_default();
            let h = headers.inner();
            let id = match h.get("x-aggregate-id") {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("x-aggregate-id missing: {other:?}"),
            };
            let seq = match h.get("x-aggregate-seq") {
                Some(AMQPValue::LongLongInt(n)) => *n,
                None => 0,
                other => panic!("x-aggregate-seq of the wrong type: {other:?}"),
            };
            e.lock().unwrap().push((id, seq));
        });
        Self {
            entries,
            tap: Tap::start(&amqp_url(), queue, record),
        }
    }

    /// Quiet before judging: see [`Collector::drain`].
    pub async fn drain(&self, timeout: Duration) {
        self.tap.drain(timeout, || async { 0 }).await;
    }

    /// Deliveries so far, copies included.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    /// Whether nothing arrived yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every delivery so far, in arrival order.
    pub fn entries(&self) -> Vec<(String, i64)> {
        self.entries.lock().unwrap().clone()
    }

    /// The sequence numbers of `aggregate`'s deliveries, in arrival order.
    pub fn seqs_of(&self, aggregate: &str) -> Vec<i64> {
        self.entries
            .lock()
            .unwrap()
            .iter()
            .filter(|(a, _)| a == aggregate)
            .map(|(_, s)| *s)
            .collect()
    }

    /// Per aggregate, its sequence numbers in the order of their first
    /// arrival, and how many deliveries were copies of one seen before.
    pub fn first_arrivals(&self) -> (HashMap<String, Vec<i64>>, usize) {
        let mut seen = std::collections::HashSet::new();
        let mut first: HashMap<String, Vec<i64>> = HashMap::new();
        let mut copies = 0;
        for (a, s) in self.entries.lock().unwrap().iter() {
            if seen.insert((a.clone(), *s)) {
                first.entry(a.clone()).or_default().push(*s);
            } else {
                copies += 1;
            }
        }
        (first, copies)
    }
}
