//! The fleet's ready queue: the tenants that may have work, as shares
//! (each tenant has one fewer than the fleet has workers, at least one, as
//! a relay has workers: a share claims the ordered partitions `p % shares
//! == share` and unordered events beside them), each share queued at most
//! once and served in turn (one batch a turn), so a tenant with a million
//! events waits its turn behind each tenant with ten, and never holds
//! every worker.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::tenant::Tenant;
use crate::mutex::lock;

/// Tenants' shares waiting for a worker's turn.
#[derive(Debug, Default)]
pub(crate) struct Ready {
    queue: std::sync::Mutex<VecDeque<(Arc<Tenant>, usize)>>,
    notify: Notify,
}

impl Ready {
    /// Queues each of `tenant`'s shares not queued already, at the tail.
    pub(crate) fn push(&self, tenant: &Arc<Tenant>) {
        for share in 0..tenant.shares() {
            self.push_share(tenant, share);
        }
    }

    /// Queues `tenant`'s share `share` at the tail, unless it is queued.
    pub(crate) fn push_share(&self, tenant: &Arc<Tenant>, share: usize) {
        if tenant.mark_queued(share) {
            lock(&self.queue).push_back((tenant.clone(), share));
            self.notify.notify_one();
        }
    }

    /// The share at the head, waiting for one; `None` once `stop` is
    /// cancelled.
    pub(crate) async fn next(&self, stop: &CancellationToken) -> Option<(Arc<Tenant>, usize)> {
        loop {
            if let Some((t, share)) = lock(&self.queue).pop_front() {
                t.unmark_queued(share);
                return Some((t, share));
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = self.notify.notified() => {}
            }
        }
    }

    /// Nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.queue).is_empty()
    }
}
