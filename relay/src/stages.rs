//! The stages of one schema's relay, built once from the configuration
//! and handed on: what a [`crate::Relay`] runs under its supervisor, and
//! what each tenant of a fleet runs in the fleet's turns.

use std::sync::Arc;

use outbox::Ident;
use sqlx::PgPool;
use uuid::Uuid;

use crate::claim::floor::Floor;
use crate::config::RelayConfig;
use crate::health::Health;
use crate::lease::Leases;
use crate::maintenance::Maintenance;
use crate::settle::Settle;
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use crate::worker::Worker;
use outbox_core::outage::Outage;

/// One schema's stages, wired together.
pub(crate) struct Stages {
    pub(crate) wakeups: Wakeups,
    pub(crate) stats: Arc<Stats>,
    pub(crate) maintenance: Arc<Maintenance>,
    pub(crate) settle: Settle,
    pub(crate) worker: Arc<Worker>,
}

impl Stages {
    /// The stages of the relay `id` on `schema` (of `pool`'s database), by
    /// `config` (whose own schema is not read), reporting to `health` and
    /// `broker_outage`.
    pub(crate) fn new(
        config: &RelayConfig,
        schema: &Ident,
        id: Uuid,
        pool: PgPool,
        health: Arc<Health>,
        broker_outage: Arc<Outage>,
    ) -> Self {
        let wakeups = Wakeups::new();
        let stats = Arc::new(Stats::new(schema));
        let floor = Arc::new(Floor::new(schema));
        let leases = Arc::new(Leases::new(schema, id, &config.name, config.lease_ttl));
        let maintenance = Arc::new(Maintenance::new(
            config,
            schema,
            pool.clone(),
            health.clone(),
            leases.clone(),
            stats.clone(),
            floor.clone(),
            wakeups.clone(),
        ));
        let settle = Settle::new(schema, config);
        let worker = Arc::new(Worker::new(
            config,
            schema,
            id,
            pool,
            floor,
            leases,
            stats.clone(),
            health,
            broker_outage,
            wakeups.clone(),
            maintenance.clone(),
            settle.clone(),
        ));
        Self {
            wakeups,
            stats,
            maintenance,
            settle,
            worker,
        }
    }
}
