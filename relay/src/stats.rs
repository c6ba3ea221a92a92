//! What this relay settled since it started: the counters behind
//! [`Relay::published`](crate::Relay::published) and the metrics, and the
//! minute rows of `outbox_publish_stats` (the console's publish-rate
//! chart), written by the maintenance round, never by a batch. Shared by
//! the table's workers and the log's reader.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use outbox::Ident;
use sqlx::{PgPool, SqlStr};

use crate::mutex::lock;
use crate::settle::Settled;

#[derive(Debug)]
pub(crate) struct Stats {
    /// Events confirmed by the broker and settled, since start.
    published: AtomicU64,
    /// Events dead-lettered by this relay, since start.
    dead_lettered: AtomicU64,
    /// `(published, dead_lettered)` as last added to `outbox_publish_stats`.
    written: Mutex<(u64, u64)>,
    /// `stats/publish_stats.sql`.
    statement: SqlStr,
}

impl Stats {
    pub(crate) fn new(schema: &Ident) -> Self {
        Self {
            published: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            written: Mutex::new((0, 0)),
            statement: crate::sql::render(include_str!("stats/publish_stats.sql"), schema),
        }
    }

    /// Adds `delivered` and what `settled` retried and dead-lettered to the
    /// counters and metrics.
    pub(crate) fn add(&self, delivered: usize, settled: &Settled) {
        metrics::counter!("outbox_relay_published_total").increment(delivered as u64);
        self.published
            .fetch_add(delivered as u64, Ordering::Relaxed);
        metrics::counter!("outbox_relay_failed_total").increment(settled.retried as u64);
        metrics::counter!("outbox_relay_dead_lettered_total")
            .increment(settled.dead_lettered as u64);
        self.dead_lettered
            .fetch_add(settled.dead_lettered as u64, Ordering::Relaxed);
    }

    /// Events delivered since start.
    pub(crate) fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Adds what was settled since the last write to the minute's row of
    /// `outbox_publish_stats`. A failed write is carried over to the next
    /// round.
    pub(crate) async fn write(&self, pool: &PgPool) {
        let now = (
            self.published.load(Ordering::Relaxed),
            self.dead_lettered.load(Ordering::Relaxed),
        );
        let last = *lock(&self.written);
        let (published, dead) = (now.0 - last.0, now.1 - last.1);
        if published == 0 && dead == 0 {
            return;
        }
        let written = sqlx::query(self.statement.clone())
            .bind(published as i64)
            .bind(dead as i64)
            .execute(pool)
            .await;
        match written {
            Ok(_) => *lock(&self.written) = now,
            Err(e) => tracing::debug!(error = %e, "could not record publish stats; next round"),
        }
    }
}
