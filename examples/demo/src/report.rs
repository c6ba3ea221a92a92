//! The end of the story: facts gathered from the databases, the wire and
//! the consumers, printed, and the checks that make the exit code.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};
use outbox_consumer::ConsumerStats;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::broker::Broker;
use crate::env::{self, SCHEMA};
use crate::traffic::Traffic;
use crate::wire::Wire;

/// Stock of every sku before the demo.
pub(crate) const INITIAL_STOCK: i64 = 1_000_000;

/// What the run did, measured after everything stopped.
#[derive(Debug)]
pub(crate) struct Facts {
    pub(crate) elapsed: Duration,
    pub(crate) requests: u64,
    pub(crate) accepted: u64,
    pub(crate) replayed: u64,
    pub(crate) in_use: u64,
    pub(crate) key_reused: u64,
    pub(crate) invalid: u64,
    pub(crate) mismatched: u64,
    pub(crate) unexpected: u64,
    /// Sum of the quantities of the orders the clients saw accepted.
    pub(crate) ordered_by_clients: i64,
    pub(crate) order_rows: u64,
    /// Ordered quantity per sku, from the orders table.
    pub(crate) ordered: BTreeMap<String, i64>,
    /// Stock taken per sku, from the inventory's table.
    pub(crate) taken: BTreeMap<String, i64>,
    pub(crate) relay_kills: usize,
    pub(crate) unpublished: u64,
    pub(crate) outbox_left: i64,
    pub(crate) wire_deliveries: u64,
    pub(crate) wire_distinct: u64,
    pub(crate) abandoned: usize,
    pub(crate) abandoned_published: usize,
    pub(crate) injected: u64,
    pub(crate) inventory: ConsumerStats,
    pub(crate) notifications: ConsumerStats,
    pub(crate) notification_rows: i64,
    /// Orders with exactly one notification.
    pub(crate) notified_once: u64,
    /// Messages in the consumers' work and retry queues once they stopped:
    /// deliveries never settled.
    pub(crate) unsettled: u64,
    /// Events the inventory consumer applied: its inbox rows, each written
    /// in its effect's transaction. (`ConsumerStats::processed` counts an
    /// effect once its ack went out: one whose ack a lost node took is
    /// counted as a duplicate when it comes back.)
    pub(crate) inventory_inbox: u64,
    /// Events the notifications consumer applied: its inbox rows.
    pub(crate) notifications_inbox: u64,
}

/// Where the facts come from.
pub(crate) struct Sources<'a> {
    pub(crate) elapsed: Duration,
    pub(crate) relay_kills: usize,
    pub(crate) injected: u64,
    pub(crate) abandoned: &'a [Uuid],
    pub(crate) inventory: ConsumerStats,
    pub(crate) notifications: ConsumerStats,
    pub(crate) orders_db: &'a PgPool,
    pub(crate) inventory_db: &'a PgPool,
    pub(crate) notifications_db: &'a PgPool,
    pub(crate) stock: &'a inventory::Stock,
    pub(crate) notes: &'a notifications::Notifications,
    pub(crate) traffic: &'a Traffic,
    pub(crate) wire: &'a Wire,
    pub(crate) broker: &'a Broker,
}

impl Sources<'_> {
    pub(crate) async fn gather(&self) -> Result<Facts> {
        let t = self.traffic;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::SeqCst);
        let rows: Vec<(String, String, i32, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id::text, sku, qty, event_id::text FROM {SCHEMA}.orders"
        )))
        .fetch_all(self.orders_db)
        .await?;
        let outbox_left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {SCHEMA}.outbox"
        )))
        .fetch_one(self.orders_db)
        .await?;
        let on_wire = self.wire.ids();
        let mut ordered = BTreeMap::new();
        for (_, sku, qty, _) in &rows {
            *ordered.entry(sku.clone()).or_default() += i64::from(*qty);
        }
        let taken = self
            .stock
            .levels(self.inventory_db)
            .await?
            .into_iter()
            .map(|(sku, qty)| (sku, INITIAL_STOCK - qty))
            .filter(|(_, taken)| *taken != 0)
            .collect();
        let per_order = self.notes.per_order(self.notifications_db).await?;
        let order_ids: HashSet<&str> = rows.iter().map(|(id, ..)| id.as_str()).collect();
        let inventory_inbox = inbox_rows(self.inventory_db, inventory::CONSUMER_NAME).await?;
        let notifications_inbox =
            inbox_rows(self.notifications_db, notifications::CONSUMER_NAME).await?;
        let unsettled = self
            .broker
            .ready(&env::unsettled_queues())
            .await
            .context("counting the messages left in the consumers' queues")?;
        let clients = t.orders.lock().unwrap();
        Ok(Facts {
            elapsed: self.elapsed,
            requests: get(&t.requests),
            accepted: get(&t.accepted),
            replayed: get(&t.replayed),
            in_use: get(&t.in_use),
            key_reused: get(&t.key_reused),
            invalid: get(&t.invalid),
            mismatched: get(&t.mismatched),
            unexpected: get(&t.unexpected),
            ordered_by_clients: clients.values().map(|o| i64::from(o.qty)).sum(),
            order_rows: rows.len() as u64,
            ordered,
            taken,
            relay_kills: self.relay_kills,
            unpublished: rows.iter().filter(|r| !on_wire.contains(&r.3)).count() as u64,
            outbox_left,
            wire_deliveries: self.wire.deliveries(),
            wire_distinct: self.wire.distinct(),
            abandoned: self.abandoned.len(),
            abandoned_published: self
                .abandoned
                .iter()
                .filter(|id| on_wire.contains(&id.to_string()))
                .count(),
            injected: self.injected,
            inventory: self.inventory,
            notifications: self.notifications,
            notification_rows: per_order.values().sum(),
            notified_once: per_order
                .iter()
                .filter(|(id, n)| **n == 1 && order_ids.contains(id.as_str()))
                .count() as u64,
            unsettled,
            inventory_inbox,
            notifications_inbox,
        })
    }
}

impl Facts {
    /// Deliveries each consumer queue received at least: every event
    /// published plus the injected copies. The relay's copies of an event
    /// come on top (as many as on the audit queue, unless a node failed
    /// under a publish: each queue keeps or loses its own copy).
    pub(crate) fn deliveries_per_queue(&self) -> u64 {
        self.wire_distinct + self.injected
    }

    /// The checks, each with its verdict.
    pub(crate) fn checks(&self) -> Vec<(String, bool)> {
        let n = self.accepted;
        let total_taken: i64 = self.taken.values().sum();
        let expected = self.deliveries_per_queue();
        vec![
            (
                format!(
                    "each order executed once, retries got its answer ({n} orders, {} rows)",
                    self.order_rows
                ),
                self.mismatched == 0 && self.unexpected == 0 && self.order_rows == n,
            ),
            (
                format!(
                    "every committed event published ({} of {}; outbox empty)",
                    self.order_rows - self.unpublished,
                    self.order_rows
                ),
                self.unpublished == 0 && self.outbox_left == 0,
            ),
            (
                format!(
                    "no event of a rolled-back transaction published (0 of {})",
                    self.abandoned
                ),
                self.abandoned_published == 0,
            ),
            (
                format!(
                    "stock moved exactly once per order ({} taken = {} ordered, per sku too; \
                     {} events in the inbox)",
                    total_taken, self.ordered_by_clients, self.inventory_inbox
                ),
                self.taken == self.ordered
                    && total_taken == self.ordered_by_clients
                    && self.inventory_inbox == n,
            ),
            (
                format!(
                    "one notification per order ({} orders, {} notifications, {} events in \
                     the inbox)",
                    n, self.notification_rows, self.notifications_inbox
                ),
                self.notified_once == n
                    && self.notification_rows == n as i64
                    && self.notifications_inbox == n,
            ),
            (
                format!(
                    "every delivery settled, duplicates absorbed ({} and {} acked, at least {} \
                     each; {} left in the queues)",
                    self.inventory.acked(),
                    self.notifications.acked(),
                    expected,
                    self.unsettled
                ),
                self.unsettled == 0
                    && self.inventory.acked() >= expected
                    && self.notifications.acked() >= expected,
            ),
        ]
    }

    /// Prints the report; returns whether every check passed.
    pub(crate) fn print(&self) -> bool {
        let (inv, not) = (&self.inventory, &self.notifications);
        let again = self.wire_deliveries - self.wire_distinct;
        println!("\n==== report ({:.1}s) ====", self.elapsed.as_secs_f64());
        row("orders accepted (HTTP 201)", self.accepted, "");
        row("HTTP requests sent", self.requests, "");
        row(
            "  retries replayed",
            self.replayed,
            "same key: recorded answer, nothing written",
        );
        row("  409 while the first ran", self.in_use, "retried");
        row(
            "  key reused, other order",
            self.key_reused,
            "422, nothing written",
        );
        row(
            "  invalid orders",
            self.invalid,
            "400, recorded and replayed",
        );
        row(
            "transactions rolled back",
            self.abandoned,
            "order and event written, never committed",
        );
        row(
            "relay crashes",
            self.relay_kills,
            "aborted with batches in flight, restarted",
        );
        row(
            "events published",
            self.wire_distinct,
            &format!("{again} published again after a crash"),
        );
        row(
            "duplicates injected",
            self.injected,
            "per consumer queue, same message_id",
        );
        row("", "inventory  notifications", "");
        let both = |label: &str, a: u64, b: u64| row(label, format!("{a:>9}  {b:>13}"), "");
        both("deliveries received", inv.acked(), not.acked());
        both("effects applied", inv.processed, not.processed);
        both("duplicate deliveries seen", inv.duplicates, not.duplicates);
        both("retried", inv.retried, not.retried);
        both(
            "dead-lettered",
            inv.rejected + inv.poison,
            not.rejected + not.poison,
        );
        println!("\nchecks");
        let mut all = true;
        for (what, ok) in self.checks() {
            all &= ok;
            println!("  {}  {what}", if ok { "ok  " } else { "FAIL" });
        }
        all
    }
}

/// Rows of `consumer` in the inbox of the demo's schema in `pool`.
async fn inbox_rows(pool: &PgPool, consumer: &str) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {SCHEMA}.inbox_processed WHERE consumer = $1"
    )))
    .bind(consumer)
    .fetch_one(pool)
    .await
    .with_context(|| format!("counting {consumer}'s inbox"))?;
    Ok(n as u64)
}

/// One line of the report: a label, a value and an optional note.
fn row(label: &str, value: impl std::fmt::Display, note: &str) {
    if note.is_empty() {
        println!("{label:<30}{value}");
    } else {
        println!("{label:<30}{value}  ({note})");
    }
}
