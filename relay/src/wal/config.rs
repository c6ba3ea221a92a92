//! What the log's reader takes of the relay's configuration: its own
//! [`ReaderConfig`], read by the reader (`reader.rs`) and its sessions'
//! stream (`stream.rs`).

use std::time::Duration;

use crate::config::{RelayConfig, WalCapture};
use crate::publish::PublishSettings;

/// What the log's reader takes of the relay's configuration.
#[derive(Debug, Clone)]
pub(crate) struct ReaderConfig {
    /// Where and how to read the log.
    pub(super) wal: WalCapture,
    pub(super) publish: PublishSettings,
    /// Events per batch on the wire.
    pub(super) batch_size: usize,
    pub(super) database_timeout: Duration,
    /// The backoff's bounds between replication sessions.
    pub(super) reconnect: (Duration, Duration),
    /// The relay's name (the session's `application_name`).
    pub(super) name: String,
}

impl ReaderConfig {
    /// The reader's part of `config`; `None` without
    /// [`RelayConfig::wal`].
    pub(crate) fn new(config: &RelayConfig) -> Option<Self> {
        Some(Self {
            wal: config.wal.clone()?,
            publish: PublishSettings::new(config),
            batch_size: config.batch_size,
            database_timeout: config.database_timeout,
            reconnect: (config.reconnect_min, config.reconnect_max),
            name: config.name.clone(),
        })
    }
}
