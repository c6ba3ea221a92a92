//! The test broker: a topic exchange and queue per test ([`TestBroker`]),
//! connections, and queue declares and depths.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

use crate::{amqp_url, suffix, wait_until};

/// A topic exchange and a durable queue bound to it with `#`, named for
/// this test only. They are deleted by [`TestBroker::cleanup`], or when
/// the last clone goes, a panicking test's included; a value built from
/// its fields (`TestBroker { exchange, queue }`) deletes those names too.
#[derive(Debug)]
pub struct TestBroker {
    /// The exchange.
    pub exchange: String,
    /// The queue.
    pub queue: String,
}

/// Clones of a [`TestBroker`] still alive, by (exchange, queue), beyond
/// the first: no entry is one owner. The fields are public (so a value
/// can be built from names), so the count cannot live in the value.
static OWNERS: Mutex<BTreeMap<(String, String), usize>> = Mutex::new(BTreeMap::new());

/// Bounds of a clean-up: a broker that is down or does not answer cannot
/// hang the test that ends.
const CLEANUP_CONNECT: Duration = Duration::from_secs(5);
const CLEANUP_STEP: Duration = Duration::from_secs(5);

impl TestBroker {
    /// Declares the exchange and queue (queue arguments optional).
    pub async fn new(prefix: &str, queue_args: FieldTable) -> Self {
        let s = suffix();
        let b = Self {
            exchange: format!("test.{prefix}.{s}"),
            queue: format!("test.{prefix}.{s}.q"),
        };
        let conn = connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.exchange_declare(
            b.exchange.as_str().into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("exchange");
        let q = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(b.queue.as_str().into(), q, queue_args)
            .await
            .expect("queue");
        ch.queue_bind(
            b.queue.as_str().into(),
            b.exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
        let _ = conn.close(200, "ok".into()).await;
        b
    }

    /// Deletes the exchange and queue now (clones dropped later delete
    /// nothing more than these names again).
    pub async fn cleanup(mut self) {
        self.release();
        let (exchange, queue) = self.take_names();
        let conn = connect().await;
        delete(&conn, &exchange, &queue).await;
        let _ = bounded(conn.close(200, "ok".into())).await;
    }

    /// One owner fewer; whether it was the last.
    fn release(&self) -> bool {
        let mut owners = OWNERS.lock().unwrap_or_else(|e| e.into_inner());
        let key = (self.exchange.clone(), self.queue.clone());
        match owners.get_mut(&key) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                owners.remove(&key);
                true
            }
            None => true,
        }
    }

    /// The names, leaving none behind: a value without names has nothing
    /// to delete when dropped.
    fn take_names(&mut self) -> (String, String) {
        (
            std::mem::take(&mut self.exchange),
            std::mem::take(&mut self.queue),
        )
    }

    fn cleaned(&self) -> bool {
        self.exchange.is_empty() && self.queue.is_empty()
    }
}

impl Clone for TestBroker {
    fn clone(&self) -> Self {
        if !self.cleaned() {
            let key = (self.exchange.clone(), self.queue.clone());
            let mut owners = OWNERS.lock().unwrap_or_else(|e| e.into_inner());
            *owners.entry(key).or_insert(1) += 1;
        }
        Self {
            exchange: self.exchange.clone(),
            queue: self.queue.clone(),
        }
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if self.cleaned() || !self.release() {
            return;
        }
        let (exchange, queue) = self.take_names();
        // No runtime to await on here (and the test's may be the one
        // panicking): a thread with a runtime and a connection of its own,
        // every step bounded.
        let deleted = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the cleanup");
            rt.block_on(async {
                let url = amqp_url();
                let connect = Connection::connect(&url, ConnectionProperties::default());
                let Ok(Ok(conn)) = tokio::time::timeout(CLEANUP_CONNECT, connect).await else {
                    return Err(format!("exchange {exchange} and queue {queue} not deleted"));
                };
                delete(&conn, &exchange, &queue).await;
                let _ = bounded(conn.close(200, "ok".into())).await;
                Ok(())
            })
        })
        .join();
        match deleted {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("TestBroker: {e} (broker unreachable)"),
            Err(_) => eprintln!("TestBroker: the clean-up panicked"),
        }
    }
}

/// Deletes `queue` and `exchange` (each on a channel of its own, each step
/// bounded; what is not there, or not named, is left alone).
async fn delete(conn: &Connection, exchange: &str, queue: &str) {
    if !queue.is_empty()
        && let Some(Ok(ch)) = bounded(conn.create_channel()).await
    {
        let _ = bounded(ch.queue_delete(queue.into(), QueueDeleteOptions::default())).await;
        let _ = bounded(ch.close(200, "ok".into())).await;
    }
    if !exchange.is_empty()
        && let Some(Ok(ch)) = bounded(conn.create_channel()).await
    {
        let options = ExchangeDeleteOptions::default();
        let _ = bounded(ch.exchange_delete(exchange.into(), options)).await;
        let _ = bounded(ch.close(200, "ok".into())).await;
    }
}

/// `step`, given [`CLEANUP_STEP`] at most.
async fn bounded<F: Future>(step: F) -> Option<F::Output> {
    tokio::time::timeout(CLEANUP_STEP, step).await.ok()
}

/// A plain connection to the test broker.
pub async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("test broker reachable (run `make services`)")
}

/// A connection to the first of `urls` (comma-separated) that answers
/// within 5 s (a node that is booting or stopping may accept the TCP
/// connection and never answer the handshake).
pub async fn connect_any(urls: &str) -> anyhow::Result<Connection> {
    let mut last = anyhow::anyhow!("no URL");
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let connect = Connection::connect(url, ConnectionProperties::default());
        match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => last = e.into(),
            Err(_) => last = anyhow::anyhow!("no AMQP handshake within 5 s"),
        }
    }
    Err(last)
}

/// Declares the durable `queue` (with `args`, such as a quorum type) bound
/// to `exchange` with `pattern`: a queue that sees what the relays put on
/// the wire, for a [`Collector`](crate::Collector) or a
/// [`SeqLog`](crate::SeqLog) to record.
pub async fn declare_tap_queue(
    conn: &Connection,
    exchange: &str,
    queue: &str,
    pattern: &str,
    args: FieldTable,
) {
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), durable, args).await.unwrap();
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        pattern.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

/// (ready messages, consumers) of `queue`, from a passive declare on a
/// channel of its own; (u32::MAX, 0) while the queue cannot be read.
pub async fn depth(conn: &Connection, queue: &str) -> (u32, u32) {
    // Each broker call bounded: a call on a connection whose node died
    // may never return; the caller's wait asks again.
    let t = Duration::from_secs(5);
    let Ok(Ok(ch)) = tokio::time::timeout(t, conn.create_channel()).await else {
        return (u32::MAX, 0);
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declare = ch.queue_declare(queue.into(), passive, FieldTable::default());
    let got = match tokio::time::timeout(t, declare).await {
        Ok(Ok(q)) => (q.message_count(), q.consumer_count()),
        _ => (u32::MAX, 0),
    };
    let _ = tokio::time::timeout(t, ch.close(200, "ok".into())).await;
    got
}

/// The messages left in `queue` once it has no consumer: the queue
/// requeues a leaving consumer's unacknowledged messages in the same step
/// that removes it, so with no consumer the ready count is every message.
pub async fn settled_depth(conn: &Connection, queue: &str, deadline: Instant) -> u32 {
    let ready = Arc::new(Mutex::new(u32::MAX));
    let left = deadline.saturating_duration_since(Instant::now());
    wait_until(left, &format!("{queue} to lose its consumers"), || async {
        let (r, consumers) = depth(conn, queue).await;
        *ready.lock().unwrap() = r;
        consumers == 0 && r != u32::MAX
    })
    .await;
    *ready.lock().unwrap()
}
