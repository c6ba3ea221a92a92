//! The log's reader: one replication session at a time, supervised like
//! the broker connection (reconnect with backoff, standby while another
//! relay holds the slot), every network wait bounded. It depends on what
//! its constructor is given: the broker seam, the settle stage (through
//! `divert`), the relay's stats and its workers' wake-up; never on the
//! table's workers or supervisor.

use std::sync::Arc;
use std::time::Duration;

use lapin::Connection;
use outbox::Ident;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, blocked_now, unblocked};
use crate::error::{ConfigError, Error, Result};
use crate::publish::Publisher;
use crate::settle::Settle;
use crate::stats::Stats;
use crate::wakeup::Wakeups;
use crate::wal::config::ReaderConfig;
use crate::wal::decode::lsn_text;
use crate::wal::divert;
use crate::wal::slot::{self, refusal, slot_busy, slot_row, wal_error};
use crate::wal::stream::{ReadEnd, Stream};
use outbox_core::backoff::Backoff;
use outbox_core::backoff::sleep_or_cancel;
use outbox_core::outage::Outage;

/// The longest a busy reader waits before it reports a delivered position
/// to the slot. A status update is one small message with no answer, so
/// fifty a second cost PostgreSQL nothing it would notice.
const FEEDBACK: Duration = Duration::from_millis(20);

/// The reader of one schema's slot.
pub(crate) struct WalReader {
    config: ReaderConfig,
    slot: String,
    pool: PgPool,
    outage: Outage,
    broker: Arc<Broker>,
    /// What a session's stream runs on.
    stream: Stream,
}

impl WalReader {
    /// The reader of `slot` for `schema`; its failed events are recorded
    /// by `settle`'s rules.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: ReaderConfig,
        schema: &Ident,
        slot: &str,
        pool: &PgPool,
        broker: Arc<Broker>,
        stats: Arc<Stats>,
        wakeups: Wakeups,
        settle: Settle,
    ) -> Self {
        Self {
            stream: Stream::new(
                config.clone(),
                schema,
                slot,
                pool.clone(),
                divert::Divert::new(schema, settle),
                stats,
                wakeups,
            ),
            config,
            slot: slot.to_owned(),
            pool: pool.clone(),
            outage: Outage::new("replication stream", "outbox-relay"),
            broker,
        }
    }

    /// Reads the slot until `shutdown`: publishes what it holds, waits as
    /// a standby while another relay reads it, reconnects after failures.
    /// Returns `Err` only for what no retry fixes ([`Error::WalRefused`],
    /// a refused broker login).
    pub(crate) async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let cfg = &self.config;
        let mut backoff = Backoff::new(cfg.reconnect.0, cfg.reconnect.1);
        let mut standby: Option<String> = None;
        while !shutdown.is_cancelled() {
            match self.session(&shutdown, &mut backoff).await {
                Ok(ReadEnd::Shutdown) => break,
                Ok(ReadEnd::Standby(holder)) => {
                    if standby.as_ref() != Some(&holder) {
                        tracing::info!(slot = %self.slot, holder = %holder, "standby: another session reads the slot; this relay takes over when it is free");
                        standby = Some(holder);
                    }
                    metrics::gauge!("outbox_relay_wal_reading").set(0.0);
                    sleep_or_cancel(self.config.wal.standby_poll, &shutdown).await;
                }
                Err(e) if e.is_refusal() => {
                    tracing::error!(slot = %self.slot, error = %e, "write-ahead-log capture stopped");
                    return Err(e);
                }
                Err(e) => {
                    standby = None;
                    self.outage.failed(&e);
                    sleep_or_cancel(backoff.next_delay(), &shutdown).await;
                }
            }
        }
        Ok(())
    }

    /// One broker session: check the slot, connect the broker, then read
    /// in replication sessions until shutdown or a failure. A broker that
    /// blocks publishing (a resource alarm) ends the replication session
    /// only: the reader waits on the same connection for the block to
    /// lift, then reads again from the slot's confirmed position (a new
    /// connection would be blocked too, and the old one, cut while
    /// blocked, stays on the broker's list until the broker writes to it).
    async fn session(
        &self,
        shutdown: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<ReadEnd> {
        let mut confirmed = match self.readable_from().await? {
            Ok(confirmed) => confirmed,
            Err(standby) => return Ok(standby),
        };
        let session = self.broker.connect("log reader").await?;
        let end = loop {
            let end = self
                .session_on(&session.conn, confirmed, backoff, shutdown)
                .await;
            match end {
                Err(e) if e.is_broker() && blocked_now(&session.conn) => {
                    tracing::info!(slot = %self.slot, error = %e, "replication session ended while the broker blocks publishing; reading again once it lifts");
                    if !unblocked(&session.conn, shutdown).await {
                        break Ok(ReadEnd::Shutdown);
                    }
                    match self.readable_from().await? {
                        Ok(from) => confirmed = from,
                        Err(standby) => break Ok(standby),
                    }
                }
                end => break end,
            }
        };
        if end.as_ref().is_err_and(Error::is_broker) {
            // As the table's sessions do: the next connection starts after
            // the node that failed.
            self.broker.leave(session.node);
        }
        // Closed (or cut, when blocked) before the next one opens.
        session.close(self.config.publish.broker_timeout).await;
        end
    }

    /// Where the slot can be read from: its confirmed position, or (as
    /// `Err`) a standby's end while another session holds it.
    async fn readable_from(&self) -> Result<std::result::Result<Lsn, ReadEnd>> {
        let row = slot_row(&self.pool, &self.slot).await?;
        if let Some(e) = refusal(&self.slot, row.as_ref()) {
            return Err(e);
        }
        let row = row.expect("refusal() checked it exists");
        if row.active {
            return Ok(Err(ReadEnd::Standby(
                row.holder.unwrap_or_else(|| "another session".to_owned()),
            )));
        }
        Ok(Ok(row
            .confirmed_flush_lsn
            .as_deref()
            .and_then(|l| Lsn::parse(l).ok())
            .unwrap_or(Lsn::ZERO)))
    }

    /// [`session`](Self::session) on the broker connection `conn`, from
    /// the slot's position `confirmed`.
    async fn session_on(
        &self,
        conn: &Arc<Connection>,
        confirmed: Lsn,
        backoff: &mut Backoff,
        shutdown: &CancellationToken,
    ) -> Result<ReadEnd> {
        let cfg = &self.config;
        // A connection the broker blocks opens no channel: wait for the
        // lift before the replication session starts (nothing is read,
        // the slot stays where it is).
        if !unblocked(conn, shutdown).await {
            return Ok(ReadEnd::Shutdown);
        }
        let mut publisher = Publisher::open(conn, cfg.publish.broker_timeout).await?;
        let mut client = ReplicationClient::connect(self.source(confirmed)?)
            .await
            .map_err(|e| wal_error(&self.slot, e))?;
        let started = tokio::time::timeout(cfg.publish.broker_timeout, client.wait_started()).await;
        let mut acked = confirmed;
        // The backend serving this session, once known.
        let mut walsender = None;
        let end = match started {
            Ok(Ok(())) => {
                self.outage.ok();
                backoff.reset();
                metrics::gauge!("outbox_relay_wal_reading").set(1.0);
                tracing::info!(slot = %self.slot, from = %lsn_text(confirmed.as_u64()), "reading the write-ahead log");
                // Our session's backend, to tell later whether the server
                // still holds the stream for us (see `stream.rs`).
                walsender = slot::holder_pid(&self.pool, &self.slot, cfg.database_timeout)
                    .await
                    .ok()
                    .flatten();
                let end = self
                    .stream
                    .stream(
                        &mut client,
                        &mut publisher,
                        conn,
                        shutdown,
                        &mut acked,
                        &mut walsender,
                    )
                    .await;
                metrics::gauge!("outbox_relay_wal_reading").set(0.0);
                end
            }
            Ok(Err(e)) if slot_busy(&e) => Ok(ReadEnd::Standby("another session".to_owned())),
            Ok(Err(e)) => Err(wal_error(&self.slot, e)),
            Err(_) => Err(Error::Replication(format!(
                "the server did not start replication within {:?}",
                cfg.publish.broker_timeout
            ))),
        };
        // A clean stop frees the slot at once for a standby.
        if tokio::time::timeout(cfg.publish.broker_timeout, client.shutdown())
            .await
            .is_err()
        {
            client.abort();
        }
        publisher.close().await;
        if acked > confirmed {
            // Whether this session stopped or failed (a confirm timeout
            // ends it just after it recorded the timed-out batch), move the
            // slot to what was confirmed (delivered or recorded).
            slot::advance(
                &self.pool,
                &self.slot,
                acked,
                walsender,
                cfg.publish.broker_timeout,
            )
            .await;
        }
        end
    }

    /// Where the replication connection goes and how it reports, from
    /// `confirmed` on.
    fn source(&self, confirmed: Lsn) -> Result<ReplicationConfig> {
        let (cfg, wal) = (&self.config, &self.config.wal);
        let mut source = crate::wal::source(wal.database_url.expose())
            .map_err(|e| Error::Config(ConfigError::Url(e)))?;
        source.slot = self.slot.clone();
        source.publication = self.slot.clone().into();
        // An idle reader reports four times a second, and at least four
        // times per sender timeout, so a live reader is never taken for a
        // dead one.
        let every =
            (wal.sender_timeout / 4).clamp(Duration::from_millis(100), Duration::from_millis(250));
        Ok(source
            .with_start_lsn(confirmed)
            .with_ack_lsn(confirmed)
            // A busy one reports what was delivered within FEEDBACK: what a
            // new session reads again after a reset is the window on the
            // wire and FEEDBACK's worth of events, not `every`'s.
            .with_status_interval(FEEDBACK.min(every))
            .with_wakeup_interval(every)
            // Two batches ahead of the reader, beside those on the wire.
            .with_buffer_size((cfg.batch_size * 2).max(256))
            .with_application_name(format!("outbox-relay {}", cfg.name))
            // TCP keepalive on the server's side (this client's socket is
            // the replication library's, which sets none): a session
            // whose link went silent ends within about 25 s even where
            // the sender timeout is long.
            .with_options(format!(
                "-c wal_sender_timeout={} -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 \
                 -c tcp_keepalives_count=3 -c tcp_user_timeout=25000",
                wal.sender_timeout.as_millis()
            )))
    }
}
