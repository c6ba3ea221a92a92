//! One progress line a second while the demo runs.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use outbox_consumer::Consumer;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::task::JoinHandle;

use crate::env::SCHEMA;
use crate::traffic::Traffic;
use crate::wire::Wire;

/// What the progress line reads.
#[derive(Debug, Clone)]
pub(crate) struct Progress {
    pub(crate) started: Instant,
    pub(crate) total: usize,
    pub(crate) traffic: Arc<Traffic>,
    pub(crate) wire: Arc<Wire>,
    pub(crate) inventory: Consumer,
    pub(crate) notifications: Consumer,
    pub(crate) orders_db: PgPool,
}

impl Progress {
    /// Prints the line now.
    pub(crate) async fn print(&self) {
        let backlog: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {SCHEMA}.outbox"
        )))
        .fetch_one(&self.orders_db)
        .await
        .unwrap_or(-1);
        let (inv, not) = (self.inventory.stats(), self.notifications.stats());
        println!(
            "[{:5.1}s] orders {:>5}/{} | outbox {:>4} | published {:>5} +{} | \
             inventory {:>5} +{} dup | notifications {:>5} +{} dup",
            self.started.elapsed().as_secs_f64(),
            self.traffic.accepted.load(Ordering::SeqCst),
            self.total,
            backlog,
            self.wire.distinct(),
            self.wire.deliveries() - self.wire.distinct(),
            inv.processed,
            inv.duplicates,
            not.processed,
            not.duplicates,
        );
    }

    /// Prints the line every second until aborted.
    pub(crate) fn spawn(self) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                self.print().await;
            }
        })
    }
}
