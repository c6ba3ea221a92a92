//! The WAL drain's design ceiling: the least code that reads the outbox's
//! slot the way the relay's design does, written by hand. It streams the
//! slot (pgoutput, logical decoding messages of `outbox_emit`), publishes
//! each event as the message of the contract with its confirms pipelined
//! (batches of what is ready, a few batches' worth of events on the wire),
//! and confirms a transaction's end position to the slot once every
//! confirm before it has arrived. Nothing else: no ordered aggregates, no
//! dead letters, no supervision. Its tuning is swept and the best kept.

use std::collections::VecDeque;

use anyhow::{Context, Result};
use futures_util::FutureExt;
use lapin::options::BasicPublishOptions;
use lapin::{Channel, Confirmation, PublisherConfirm};
use outbox::{OrderedAggregates, wire};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::PgPool;

use crate::common::*;
use crate::minimal::contract_properties;
use crate::relay::Backlog;

/// How the hand-written reader batches: up to `batch` events per batch,
/// up to `batch * window` events unconfirmed (in at most
/// [`MOST_BATCHES_ON_WIRE`] batches: a batch is what was ready, often
/// fewer than `batch`). The relay bounds its window the same way, but
/// counts every event of a batch until the whole batch is confirmed; this
/// reader counts only the confirms not yet in, so it may hold up to about
/// one batch more on the wire (which can only help a ceiling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReaderTuning {
    pub(crate) batch: usize,
    pub(crate) window: usize,
}

impl std::fmt::Display for ReaderTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "batch {}, {} batches' worth on the wire",
            self.batch, self.window
        )
    }
}

/// What the sweep tries; the best one is the design ceiling. The relay's
/// own default (batch 500, four batches' worth on the wire) is one.
pub(crate) const READER_SWEEP: [ReaderTuning; 4] = [
    ReaderTuning {
        batch: 250,
        window: 8,
    },
    ReaderTuning {
        batch: 500,
        window: 4,
    },
    ReaderTuning {
        batch: 500,
        window: 8,
    },
    ReaderTuning {
        batch: 1000,
        window: 8,
    },
];

/// Batches on the wire at most, however small (the relay's bound too).
const MOST_BATCHES_ON_WIRE: usize = 64;

/// The content of an `outbox_emit` message (docs/WAL_CAPTURE.md), the
/// fields the message needs.
#[derive(Deserialize)]
struct Content<'a> {
    id: uuid::Uuid,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(borrow)]
    headers: &'a RawValue,
    created_at: chrono::DateTime<chrono::Utc>,
}

/// A replication connection to `url` (host, port, user, password and
/// database of a `postgres://` URL) reading `slot` through its publication.
fn source(url: &str, slot: &str) -> Result<ReplicationConfig> {
    let u = url::Url::parse(url).context("the database URL")?;
    let mut c = ReplicationConfig::new(
        u.host_str().unwrap_or("localhost"),
        if u.username().is_empty() {
            "postgres"
        } else {
            u.username()
        },
        u.password().unwrap_or(""),
        u.path().trim_start_matches('/'),
        slot,
        slot,
    );
    c.port = u.port().unwrap_or(5432);
    Ok(c.with_buffer_size(4096))
}

/// One message's event, decoded as it is read (the relay decodes in its
/// read loop too): publishing it is one `basic_publish`.
struct Prepared {
    key: String,
    props: lapin::BasicProperties,
    payload: Vec<u8>,
}

fn prepare(content: &[u8]) -> Result<Prepared> {
    let c: Content<'_> = serde_json::from_slice(content)?;
    anyhow::ensure!(
        c.headers.get() == "{}",
        "the minimal reader publishes no event headers"
    );
    Ok(Prepared {
        key: wire::default_routing_key(c.aggregate_type, c.event_type),
        props: contract_properties(
            c.id,
            c.aggregate_type,
            c.aggregate_id,
            c.event_type,
            c.created_at,
        ),
        payload: c.payload.get().as_bytes().to_vec(),
    })
}

/// Publishes one event; its confirm.
async fn publish(ch: &Channel, exchange: &str, p: Prepared) -> Result<PublisherConfirm> {
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    Ok(ch
        .basic_publish(
            exchange.into(),
            p.key.as_str().into(),
            opts,
            &p.payload,
            p.props,
        )
        .await?)
}

/// One batch on the wire: its confirms not yet in, and the position
/// confirmed to the slot once they all arrived.
struct OnWire {
    confirms: VecDeque<PublisherConfirm>,
    end: Option<Lsn>,
}

impl OnWire {
    /// Takes the confirms that are in, without waiting: true when all are.
    fn ready(&mut self) -> Result<bool> {
        while let Some(c) = self.confirms.front_mut() {
            match c.now_or_never() {
                Some(c) => {
                    let c = c?;
                    anyhow::ensure!(c == Confirmation::Ack(None), "not acked: {c:?}");
                    self.confirms.pop_front();
                }
                None => return Ok(false),
            }
        }
        Ok(true)
    }
}

async fn settle(client: &ReplicationClient, b: OnWire) -> Result<()> {
    for c in b.confirms {
        let c = c.await?;
        anyhow::ensure!(c == Confirmation::Ack(None), "not acked: {c:?}");
    }
    if let Some(end) = b.end {
        client.update_applied_lsn(end);
    }
    Ok(())
}

/// Reads `slot` until `n` events are published and confirmed.
async fn read(
    database_url: &str,
    slot: &str,
    prefix: &str,
    ch: Channel,
    exchange: &str,
    n: usize,
    tuning: ReaderTuning,
) -> Result<()> {
    let mut client = ReplicationClient::connect(source(database_url, slot)?).await?;
    let mut wire: VecDeque<OnWire> = VecDeque::new();
    // The batch being read: its messages' contents, published together
    // when it is full or nothing more is ready.
    let mut contents: Vec<Prepared> = Vec::with_capacity(tuning.batch);
    let mut end = None;
    let mut sent = 0;
    let window = tuning.batch * tuning.window;
    while sent < n || !contents.is_empty() {
        // What is ready, without waiting; when nothing is, send the batch.
        let event = if contents.len() >= tuning.batch {
            None
        } else if contents.is_empty() {
            Some(client.recv().await?.context("the stream ended")?)
        } else {
            match client.recv().now_or_never() {
                Some(e) => Some(e?.context("the stream ended")?),
                None => None,
            }
        };
        match event {
            Some(ReplicationEvent::Message {
                prefix: p, content, ..
            }) if p == prefix => {
                contents.push(prepare(&content)?);
                sent += 1;
            }
            Some(ReplicationEvent::Commit { end_lsn, .. }) => end = Some(end_lsn),
            Some(_) => {}
            None => {
                // Batches whose confirms are all in go first, without
                // waiting; then the oldest are waited for while the
                // window is full.
                while let Some(oldest) = wire.front_mut() {
                    if !oldest.ready()? {
                        break;
                    }
                    if let Some(b) = wire.pop_front() {
                        settle(&client, b).await?;
                    }
                }
                while wire.len() >= MOST_BATCHES_ON_WIRE || on_wire(&wire) + contents.len() > window
                {
                    let Some(oldest) = wire.pop_front() else {
                        break;
                    };
                    settle(&client, oldest).await?;
                }
                let publishes = contents
                    .drain(..)
                    .map(|c| publish(&ch, exchange, c))
                    .collect();
                let confirms = queue_all(publishes).await?;
                wire.push_back(OnWire {
                    confirms: confirms.into(),
                    end: end.take(),
                });
            }
        }
    }
    while let Some(b) = wire.pop_front() {
        settle(&client, b).await?;
    }
    let _ = client.shutdown().await;
    Ok(())
}

/// Events on the wire: confirms not yet in.
fn on_wire(wire: &VecDeque<OnWire>) -> usize {
    wire.iter().map(|b| b.confirms.len()).sum()
}

/// The log's latency ceiling: the hand-written reader following the
/// schema's slot with `tuning` until it has published `n` events, then
/// idle until `stop` (which also ends a run that failed: it must not wait
/// for events that never come),
/// on its own runtime (two workers, as the relay process has), so it does
/// not share the harness's threads.
pub(crate) fn follow(
    database_url: String,
    url: String,
    schema: String,
    exchange: String,
    n: usize,
    tuning: ReaderTuning,
    stop: tokio_util::sync::CancellationToken,
) -> std::thread::JoinHandle<Result<()>> {
    on_own_runtime(async move {
        let conn = connect_contender(&url).await?;
        let ch = confirm_channel(&conn).await?;
        let ident = outbox::Ident::new("schema", &schema)?;
        let slot = outbox::wal_slot_name(&ident);
        let prefix = outbox::wal_message_prefix(&ident);
        tokio::select! {
            read = read(&database_url, &slot, &prefix, ch, &exchange, n, tuning) => {
                read?;
                // Running until told to stop, as the relay does: a latency
                // run reads its CPU once every event has arrived.
                stop.cancelled().await;
            }
            _ = stop.cancelled() => {}
        }
        let _ = conn.close(200, "done".into()).await;
        Ok(())
    })
}

/// The hand-written reader draining a backlog of `n` events in the log
/// with `tuning`: events/s between 5% and 100% of `n` published (timed on
/// the queue, as the relay is), and CPU seconds of broker, database and
/// this process over the same span. The reader runs on a runtime and a
/// connection of its own (two workers, as the relay process has), not
/// beside the harness's timing. Needs the WAL capture on.
pub(crate) async fn drain_rate(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
    tuning: ReaderTuning,
) -> Result<(f64, (f64, f64, f64))> {
    let backlog = Backlog::new(pool, url, n, OrderedAggregates::None, 1_000).await?;
    let ident = outbox::Ident::new("schema", &backlog.schema)?;
    let slot = outbox::wal_slot_name(&ident);
    let prefix = outbox::wal_message_prefix(&ident);
    let cpu = CpuSpan::start(std::process::id());
    let (database_url, url, exchange) = (
        database_url.to_owned(),
        url.to_owned(),
        backlog.name.clone(),
    );
    let reader = on_own_runtime(async move {
        let conn = connect_contender(&url).await?;
        let ch = confirm_channel(&conn).await?;
        let read = read(&database_url, &slot, &prefix, ch, &exchange, n, tuning).await;
        let _ = conn.close(200, "done".into()).await;
        read
    });
    let warm = (n / 20) as u64;
    let timed = backlog.time_fill(warm, n as u64).await;
    let cpu = cpu.stop();
    let read = join(reader).await;
    let secs = timed?;
    read?;
    // The reader stops at its count (the relay keeps reading, so the
    // harness's own check waits for its slot to pass the log's end).
    let depth = backlog.depth().await?;
    anyhow::ensure!(
        depth == n as u64,
        "{depth} messages published for {n} events"
    );
    backlog.drop(pool).await?;
    Ok(((n as u64 - warm) as f64 / secs, cpu))
}

/// The fastest of [`READER_SWEEP`] on backlogs of `n` ([`sweep_best`]).
pub(crate) async fn sweep(
    pool: &PgPool,
    database_url: &str,
    url: &str,
    n: usize,
) -> Result<(ReaderTuning, f64)> {
    sweep_best("minimal WAL reader", &READER_SWEEP, |tuning| async move {
        Ok(drain_rate(pool, database_url, url, n, tuning).await?.0)
    })
    .await
}
