use std::time::Duration;

use outbox::Ident;
use outbox::redact::SecretUrl;

use crate::error::{ConfigError, Error, Result};

/// Everything the relay engine needs, validated. The CLI builds one from
/// flags and environment; an embedding service builds one in code. Its
/// `Debug` output redacts the passwords of `amqp_url`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// AMQP URL (`amqp://` or `amqps://`), or the URLs of several nodes
    /// of one cluster separated by commas: the relay connects to the
    /// first that answers, and on every reconnect starts with the next
    /// one. A comma in a password is written `%2C`.
    pub amqp_url: SecretUrl,
    /// Schema holding the outbox tables.
    pub schema: String,
    /// Exchange for events whose `exchange` column is NULL.
    pub default_exchange: String,
    /// Declare `default_exchange` at start (durable) with this type
    /// (`topic`, `direct`, `fanout`, `headers`); `None` leaves topology alone.
    pub declare_exchange: Option<String>,
    /// Events claimed and published per batch.
    pub batch_size: usize,
    /// Batches in flight at once (each on its own database connection and
    /// AMQP channel), so database and broker work overlap.
    pub workers: usize,
    /// Longest wait between polls when no wake-up arrives.
    pub poll_interval: Duration,
    /// Listen for wake-up notifications (polling stays the safety net).
    pub listen: bool,
    /// Attempts before an unordered event moves to the dead-letter table
    /// (ordered events block their aggregate instead, until delivered or
    /// skipped by an operator).
    pub max_attempts: i32,
    /// First retry delay; doubles per attempt, with jitter.
    pub retry_base: Duration,
    /// Cap on the retry delay.
    pub retry_max: Duration,
    /// How long to wait for the broker's confirms of a batch.
    pub confirm_timeout: Duration,
    /// Bound on connecting and on every other broker operation.
    pub broker_timeout: Duration,
    /// Bound on every database call of the relay, from its side: a call
    /// that does not answer within it (a link gone silent) fails, its
    /// connection is discarded and the work retried on a fresh one. Also
    /// the batch statements' `statement_timeout`, so the server gives up on
    /// a statement when the relay does.
    pub database_timeout: Duration,
    /// Largest payload published; bigger events are dead-lettered at once.
    pub max_payload_bytes: usize,
    /// Keep delivered events in `outbox_archive` instead of deleting them.
    pub archive: bool,
    /// With `archive`: how long the archive keeps a day. Past it the day is
    /// dropped whole (and version 1's `outbox_published` trimmed in
    /// chunks). Default 7 days.
    pub archive_retention: Duration,
    /// How long a shutdown may spend finishing the batches in flight;
    /// past it [`Relay::run`](crate::Relay::run) abandons them (rolled
    /// back, their events stay in the outbox) and returns
    /// [`Error::DrainTimedOut`](crate::Error::DrainTimedOut).
    pub drain_timeout: Duration,
    /// First reconnect delay after a broker or database outage.
    pub reconnect_min: Duration,
    /// Cap on the reconnect delay.
    pub reconnect_max: Duration,
    /// How long a partition lease of ordered events lasts without renewal.
    /// A relay renews every third of it; when a relay dies, survivors take
    /// its partitions within about this long (at once on a clean shutdown).
    pub lease_ttl: Duration,
    /// This relay's name in `outbox-relay status` (which relay holds which
    /// partitions). Default `<hostname>-<pid>`.
    pub name: String,
    /// Also publish the events written to the write-ahead log
    /// (`outbox::Capture::Wal`), read from the schema's replication slot
    /// ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)).
    /// `None` (default): the outbox table only. The table is served in
    /// both cases: events the log's reader could not deliver go there.
    pub wal: Option<WalCapture>,
}

/// The write-ahead-log capture's settings ([`RelayConfig::wal`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WalCapture {
    /// PostgreSQL URL of the replication connection: usually the relay's
    /// own database URL; its user needs the `REPLICATION` attribute (or
    /// superuser). TLS is not supported on this connection yet: use a
    /// loopback or private-network address, or a Unix socket
    /// (`postgres://user@%2Fvar%2Frun%2Fpostgresql/db`).
    pub database_url: SecretUrl,
    /// How often a standby relay (another relay holds the slot) checks
    /// whether the slot became free.
    pub standby_poll: Duration,
    /// How long the database waits for a silent reader before it ends the
    /// replication session and frees the slot for a standby
    /// (`wal_sender_timeout` of the session). The reader reports its
    /// position several times within it.
    pub sender_timeout: Duration,
}

impl WalCapture {
    /// Reads the slot over `database_url`, with the default timings.
    pub fn new(database_url: impl Into<SecretUrl>) -> Self {
        Self {
            database_url: database_url.into(),
            standby_poll: Duration::from_secs(1),
            sender_timeout: Duration::from_secs(10),
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            schema: "public".to_owned(),
            default_exchange: "outbox.events".to_owned(),
            declare_exchange: Some("topic".to_owned()),
            batch_size: 500,
            workers: 2,
            poll_interval: Duration::from_millis(500),
            listen: true,
            max_attempts: 10,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
            confirm_timeout: Duration::from_secs(15),
            broker_timeout: Duration::from_secs(10),
            database_timeout: Duration::from_secs(10),
            max_payload_bytes: outbox::DEFAULT_MAX_PAYLOAD_BYTES,
            archive: false,
            archive_retention: Duration::from_secs(7 * 24 * 3600),
            drain_timeout: Duration::from_secs(30),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            lease_ttl: Duration::from_secs(10),
            name: default_name(),
            wal: None,
        }
    }
}

fn default_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".to_owned());
    format!("{host}-{}", std::process::id())
}

impl RelayConfig {
    /// The broker URLs of [`amqp_url`](Self::amqp_url), in the order tried.
    pub fn amqp_urls(&self) -> Vec<String> {
        outbox::urls::split_urls(self.amqp_url.expose())
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// The longest a batch's publish phase may take (exchange checks,
    /// publishes and confirms together): within the transaction's idle bound,
    /// so the session, its row locks and its lease fence outlive it.
    pub(crate) fn publish_phase(&self) -> Duration {
        self.confirm_timeout + self.broker_timeout
    }

    /// Checks every setting; returns the validated schema identifier.
    pub fn validate(&self) -> Result<Ident> {
        let schema = Ident::new("schema", &self.schema)?;
        self.check().map_err(Error::Config)?;
        Ok(schema)
    }

    /// Every setting but the schema.
    fn check(&self) -> std::result::Result<(), ConfigError> {
        outbox::urls::check_urls(self.amqp_url.expose(), "AMQP URL", &["amqp", "amqps"])
            .map_err(ConfigError::Url)?;
        if self
            .amqp_urls()
            .iter()
            .any(|u| u.parse::<lapin::uri::AMQPUri>().is_err())
        {
            // lapin's own reading (its error would quote the URL).
            return Err(ConfigError::Url(
                "AMQP URL is malformed (its user, host, vhost or query parameters); the value is not shown: it may hold a password".to_owned(),
            ));
        }
        let range = |setting, allowed, got: i64, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange {
                    setting,
                    allowed,
                    got,
                })
            }
        };
        let b = self.batch_size;
        range(
            "batch size",
            "1..=10000",
            b as i64,
            (1..=10_000).contains(&b),
        )?;
        let w = self.workers;
        range("workers", "1..=64", w as i64, (1..=64).contains(&w))?;
        let a = self.max_attempts;
        range("max attempts", "at least 1", a.into(), a >= 1)?;
        if let Some(kind) = &self.declare_exchange
            && !matches!(kind.as_str(), "topic" | "direct" | "fanout" | "headers")
        {
            return Err(ConfigError::ExchangeKind(kind.clone()));
        }
        if self.declare_exchange.is_some() && self.default_exchange.is_empty() {
            return Err(ConfigError::DeclareDefaultExchange);
        }
        self.check_durations()?;
        if let Some(wal) = &self.wal {
            crate::wal::source(wal.database_url.expose()).map_err(ConfigError::Url)?;
            if wal.standby_poll.is_zero() {
                return Err(ConfigError::Zero("standby poll"));
            }
            let floor = Duration::from_secs(2);
            if wal.sender_timeout < floor {
                return Err(ConfigError::TooShort {
                    setting: "WAL sender timeout",
                    floor,
                });
            }
        }
        Ok(())
    }

    fn check_durations(&self) -> std::result::Result<(), ConfigError> {
        for (name, d) in [
            ("poll interval", self.poll_interval),
            ("confirm timeout", self.confirm_timeout),
            ("broker timeout", self.broker_timeout),
            ("retry base", self.retry_base),
            ("reconnect min", self.reconnect_min),
            ("lease TTL", self.lease_ttl),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Zero(name));
            }
        }
        // A bound a healthy round trip could miss would discard good
        // connections.
        let floor = Duration::from_millis(500);
        if self.database_timeout < floor {
            return Err(ConfigError::TooShort {
                setting: "database timeout",
                floor,
            });
        }
        if self.retry_max < self.retry_base {
            return Err(ConfigError::Inverted {
                max: "retry max",
                min: "retry base",
            });
        }
        if self.reconnect_max < self.reconnect_min {
            return Err(ConfigError::Inverted {
                max: "reconnect max",
                min: "reconnect min",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_redacts_the_password() {
        let cfg = RelayConfig {
            amqp_url: "amqp://relay:hunter2@broker/%2f".into(),
            ..Default::default()
        };
        let text = format!("{cfg:?}");
        assert!(
            !text.contains("hunter2") && text.contains("relay:***@broker"),
            "{text}"
        );
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(
            RelayConfig::default().validate().unwrap().as_str(),
            "public"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        let cases: Vec<(RelayConfig, &str)> = vec![
            (
                RelayConfig {
                    amqp_url: "http://x".into(),
                    ..Default::default()
                },
                "amqp://",
            ),
            (
                RelayConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "batch size",
            ),
            (
                RelayConfig {
                    workers: 0,
                    ..Default::default()
                },
                "workers",
            ),
            (
                RelayConfig {
                    max_attempts: 0,
                    ..Default::default()
                },
                "max attempts",
            ),
            (
                RelayConfig {
                    declare_exchange: Some("hash".into()),
                    ..Default::default()
                },
                "exchange type",
            ),
            (
                RelayConfig {
                    schema: "Bad".into(),
                    ..Default::default()
                },
                "schema",
            ),
            (
                RelayConfig {
                    poll_interval: Duration::ZERO,
                    ..Default::default()
                },
                "poll interval",
            ),
        ];
        for (cfg, needle) in cases {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }
}
