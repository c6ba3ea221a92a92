//! The clients: a small pool placing orders over HTTP, retrying like real
//! clients do (a lost response, a double click, a retry storm), and a
//! producer whose transactions die before commit.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use orders::{NewOrder, Order, Orders};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::client::{HttpClient, Reply};

/// Skus the demo orders (and seeds).
pub(crate) const SKUS: [&str; 5] = ["A-1", "A-2", "A-3", "A-4", "A-5"];

/// Attempts of one request while the server answers 409 (same key still
/// running) or 503, or the connection fails.
const MAX_ATTEMPTS: usize = 50;

/// What the clients saw, updated as they go.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    next: AtomicUsize,
    pub(crate) requests: AtomicU64,
    pub(crate) accepted: AtomicU64,
    /// Answers carrying `Idempotent-Replayed: true`.
    pub(crate) replayed: AtomicU64,
    /// 409: a request with the same key was still running; retried.
    pub(crate) in_use: AtomicU64,
    /// 422: a key reused with another body; refused, nothing written.
    pub(crate) key_reused: AtomicU64,
    /// 400: invalid orders, rejected (and the rejection replayed).
    pub(crate) invalid: AtomicU64,
    /// Retries whose answer differed from the first one (must be 0).
    pub(crate) mismatched: AtomicU64,
    /// Answers no rule explains (must be 0).
    pub(crate) unexpected: AtomicU64,
    /// Accepted orders by idempotency key.
    pub(crate) orders: Mutex<HashMap<String, Order>>,
}

/// Places `total` orders with `clients` concurrent clients.
pub(crate) async fn drive(addr: SocketAddr, total: usize, clients: usize, t: Arc<Traffic>) {
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let t = t.clone();
            tokio::spawn(async move {
                let (mut main, mut spare) = (HttpClient::new(addr), HttpClient::new(addr));
                loop {
                    let i = t.next.fetch_add(1, Ordering::SeqCst);
                    if i >= total {
                        break;
                    }
                    place(&t, i, &mut main, &mut spare).await;
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
}

fn order_body(i: usize, qty: i32) -> Vec<u8> {
    json!({ "sku": SKUS[i % SKUS.len()], "qty": qty })
        .to_string()
        .into_bytes()
}

/// Order number `i`, with the retry pattern its number picks.
async fn place(t: &Traffic, i: usize, main: &mut HttpClient, spare: &mut HttpClient) {
    let key = format!("order-{i:05}");
    let body = order_body(i, 1 + (i * 7 % 5) as i32);
    match i % 20 {
        // The response was lost: the client sends the same request again.
        0 | 1 => {
            let first = send(t, main, &key, &body).await;
            let again = send(t, main, &key, &body).await;
            settle(t, &key, &[first, again]);
        }
        // A double click: the same request twice at once.
        2 => {
            let (a, b) = tokio::join!(send(t, main, &key, &body), send(t, spare, &key, &body));
            settle(t, &key, &[a, b]);
        }
        _ => {
            let once = send(t, main, &key, &body).await;
            settle(t, &key, &[once]);
        }
    }
    if i % 100 == 3 {
        // A client bug: the same key for another order. Refused.
        let other = send(t, main, &key, &order_body(i, 99)).await;
        count_if(
            t,
            other.as_ref().is_some_and(|r| r.status == 422),
            &t.key_reused,
        );
    }
    if i % 500 == 7 {
        // An invalid order, sent twice: the rejection is recorded and replayed.
        let bad_key = format!("bad-{i:05}");
        let bad = order_body(i, 0);
        let first = send(t, main, &bad_key, &bad).await;
        let again = send(t, main, &bad_key, &bad).await;
        let ok = matches!((&first, &again),
            (Some(a), Some(b)) if a.status == 400 && b.status == 400 && b.replayed);
        count_if(t, ok, &t.invalid);
    }
}

fn count_if(t: &Traffic, ok: bool, counter: &AtomicU64) {
    if ok {
        counter.fetch_add(1, Ordering::SeqCst);
    } else {
        t.unexpected.fetch_add(1, Ordering::SeqCst);
    }
}

/// Checks the answers to every attempt of one order: all 201 with the same
/// body, at most one executed (the others replayed; an answer lost on the
/// wire may hide the executed one).
fn settle(t: &Traffic, key: &str, replies: &[Option<Reply>]) {
    let replies: Vec<&Reply> = replies.iter().flatten().collect();
    let Some(first) = replies.first() else {
        t.unexpected.fetch_add(1, Ordering::SeqCst);
        return;
    };
    let executed = replies.iter().filter(|r| !r.replayed).count();
    if replies
        .iter()
        .any(|r| r.status != first.status || r.body != first.body)
        || executed > 1
    {
        t.mismatched.fetch_add(1, Ordering::SeqCst);
    }
    match serde_json::from_slice::<Order>(&first.body) {
        Ok(order) if first.status == 201 => {
            t.accepted.fetch_add(1, Ordering::SeqCst);
            t.orders.lock().unwrap().insert(key.to_owned(), order);
        }
        _ => {
            t.unexpected.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Sends until an answer other than "busy" comes; `None` if none did.
async fn send(t: &Traffic, client: &mut HttpClient, key: &str, body: &[u8]) -> Option<Reply> {
    for _ in 0..MAX_ATTEMPTS {
        t.requests.fetch_add(1, Ordering::SeqCst);
        match client.post_json("/orders", key, body).await {
            Ok(reply) if reply.status == 409 => {
                t.in_use.fetch_add(1, Ordering::SeqCst);
            }
            Ok(reply) if reply.status == 503 => {}
            Ok(reply) => {
                if reply.replayed {
                    t.replayed.fetch_add(1, Ordering::SeqCst);
                }
                return Some(reply);
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Writes `n` orders with their events through the orders library in
/// transactions that roll back, as a request whose process dies before
/// commit would. Returns their event ids: none may ever be published.
pub(crate) async fn abandon(orders: &Orders, pool: &PgPool, n: usize) -> Result<Vec<Uuid>> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let mut tx = pool.begin().await?;
        let order = NewOrder {
            sku: SKUS[i % SKUS.len()].to_owned(),
            qty: 1,
        };
        let placed = orders.place(&mut *tx, &order).await?;
        tx.rollback().await?;
        ids.push(placed.event_id);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(ids)
}
