//! The test broker: a topic exchange and queue per test ([`TestBroker`]),
//! connections, and queue declares and depths.

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
/// this test only.
#[derive(Debug, Clone)]
pub struct TestBroker {
    /// The exchange.
    pub exchange: String,
    /// The queue.
    pub queue: String,
}

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

    /// Deletes the exchange and queue.
    pub async fn cleanup(self) {
        let conn = connect().await;
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = ch
                .exchange_delete(
                    self.exchange.as_str().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
        }
        let _ = conn.close(200, "ok".into()).await;
    }
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
    let Ok(ch) = conn.create_channel().await else {
        return (u32::MAX, 0);
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let got = match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => (q.message_count(), q.consumer_count()),
        Err(_) => (u32::MAX, 0),
    };
    let _ = ch.close(200, "ok".into()).await;
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
