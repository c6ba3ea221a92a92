//! The maintenance round beside the workers, every third of the lease TTL
//! while the relay has a broker session (the first is run by the first
//! worker whose channel opened, before its first claim): the lease round
//! ([`Leases`](crate::lease::Leases)), then the broker node in use and the
//! publish stats ([`Stats`](crate::stats::Stats)). A batch never runs it.

use tokio_util::sync::CancellationToken;

use crate::relay::Relay;
use crate::wake::sleep_or_cancel;

impl Relay {
    /// One round, if one is due.
    pub(crate) async fn maintenance_round(&self) {
        let inner = &self.inner;
        let node = inner.health.broker_node();
        if inner.leases.round(&inner.pool, node).await {
            inner.stats.write(&inner.pool).await;
        }
    }

    /// Rounds until `stop`.
    pub(crate) async fn maintain(&self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            sleep_or_cancel(self.inner.leases.every(), &stop).await;
            self.maintenance_round().await;
        }
    }
}
