//! The table drain's design ceiling: the least code that drains the outbox
//! the way the relay's design does, written by hand. Each loop, on its own
//! database connection and confirm-mode channel: `BEGIN`, claim the oldest
//! due rows with `FOR UPDATE SKIP LOCKED`, publish each as the message of
//! the contract (docs/AMQP_MESSAGE.md) with every confirm pipelined behind
//! the whole batch, `DELETE` the claimed ids, `COMMIT` (asynchronous, as
//! the relay's). Nothing else: no leases, no stats, no retries, no
//! supervision. Its tuning (loops, batch size) is swept and the best kept.
//! A relay faster than this means the ceiling is wrong.

use anyhow::Result;
use chrono::{DateTime, Utc};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation};
use outbox::{OrderedAggregates, wire};
use sqlx::{AssertSqlSafe, PgPool, SqlSafeStr, SqlStr};
use uuid::Uuid;

use crate::common::*;
use crate::relay::Backlog;
use crate::stages::{self, StageLog, now_us};

/// How the hand-written loop drains: `loops` concurrent loops, each
/// claiming up to `batch` rows per transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LoopTuning {
    pub(crate) loops: usize,
    pub(crate) batch: usize,
}

impl std::fmt::Display for LoopTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} loop(s) x batch {}", self.loops, self.batch)
    }
}

/// What the sweep tries; the best one is the design ceiling.
pub(crate) const LOOP_SWEEP: [LoopTuning; 6] = [
    LoopTuning {
        loops: 1,
        batch: 500,
    },
    LoopTuning {
        loops: 2,
        batch: 250,
    },
    LoopTuning {
        loops: 2,
        batch: 500,
    },
    LoopTuning {
        loops: 2,
        batch: 1000,
    },
    LoopTuning {
        loops: 4,
        batch: 250,
    },
    LoopTuning {
        loops: 4,
        batch: 500,
    },
];

type Row = (Uuid, String, String, String, String, String, DateTime<Utc>);

/// One loop's statements on its schema: the relay's own, cut to what the
/// message needs, or with a burden the relay's own `BEGIN` and claim.
#[derive(Clone)]
struct Statements {
    begin: SqlStr,
    claim: SqlStr,
    delete: SqlStr,
    /// `--latency-hand-written-burden`: the claim is the relay's (its
    /// probe row, all its columns) and each event burns this many
    /// microseconds of CPU after the commit.
    burden: Option<u64>,
}

impl Statements {
    fn own(schema: &str) -> Self {
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        Self {
            begin: ASYNC_COMMIT.into_sql_str(),
            claim: sql(format!(
                "SELECT id, aggregate_type, aggregate_id, event_type, payload::text, \
                 headers::text, created_at FROM \"{schema}\".outbox \
                 WHERE available_at <= now() AND aggregate_seq IS NULL \
                 ORDER BY available_at, id LIMIT $1 FOR UPDATE SKIP LOCKED"
            )),
            delete: sql(format!(
                "DELETE FROM \"{schema}\".outbox WHERE id = ANY($1)"
            )),
            burden: None,
        }
    }

    /// The relay's `BEGIN` (with its bounds) and its claim while no
    /// ordered event waits (`claim/unordered.sql`), as the relay renders
    /// them for `schema`, with `burn_us` of CPU per event.
    async fn relays(
        pool: &PgPool,
        url: &str,
        schema: &str,
        exchange: &str,
        burn_us: u64,
    ) -> Result<Self> {
        let config = crate::relay::relay_config(url, schema, exchange);
        let relay = outbox_relay::Relay::new(pool.clone(), config).await?;
        let [begin, _, claim, _] = relay.batch_statements();
        let sql = |text: String| AssertSqlSafe(text).into_sql_str();
        Ok(Self {
            begin: sql(begin),
            claim: sql(claim),
            burden: Some(burn_us),
            ..Self::own(schema)
        })
    }

    /// Up to `batch` due rows. The relay's claim returns its probe's row
    /// too (no event when nothing is due), and columns the message of an
    /// event without its own exchange, key or headers does not need: they
    /// are read all the same, as the relay reads them.
    async fn claim(&self, tx: &mut sqlx::PgConnection, batch: usize) -> Result<Vec<Row>> {
        if self.burden.is_none() {
            return Ok(sqlx::query_as(self.claim.clone())
                .bind(batch as i64)
                .fetch_all(tx)
                .await?);
        }
        // The relay's claim from the index's beginning, its probe too.
        let beginning = (None::<chrono::DateTime<chrono::Utc>>, Uuid::nil());
        let claimed = sqlx::query(self.claim.clone())
            .bind(batch as i64)
            .bind(beginning.0)
            .bind(beginning.1)
            .bind(beginning.0)
            .bind(beginning.1)
            .fetch_all(tx)
            .await?;
        let mut rows = Vec::new();
        for r in claimed {
            use sqlx::Row as _;
            let _: bool = r.try_get("ordered_waiting")?;
            let Some(id) = r.try_get::<Option<Uuid>, _>("id")? else {
                continue;
            };
            let _: (Option<String>, Option<String>, i32, Option<i64>) = (
                r.try_get("exchange")?,
                r.try_get("routing_key")?,
                r.try_get("attempts")?,
                r.try_get("aggregate_seq")?,
            );
            rows.push((
                id,
                r.try_get("aggregate_type")?,
                r.try_get("aggregate_id")?,
                r.try_get("event_type")?,
                r.try_get("payload")?,
                r.try_get("headers")?,
                r.try_get("created_at")?,
            ));
        }
        Ok(rows)
    }

    /// The burden's CPU for `events` events (none without a burden).
    fn burn(&self, events: usize) {
        let Some(us) = self.burden.filter(|us| *us > 0) else {
            return;
        };
        let until = std::time::Instant::now()
            + std::time::Duration::from_micros(us.saturating_mul(events as u64));
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// The contract's properties, built by hand for an event without headers
/// of its own (both hand-written ceilings publish the fixture's events,
/// which carry none; each checks that).
pub(crate) fn contract_properties(
    id: Uuid,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    created_at: DateTime<Utc>,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        wire::HEADER_AGGREGATE_TYPE.into(),
        AMQPValue::LongString(aggregate_type.into()),
    );
    headers.insert(
        wire::HEADER_AGGREGATE_ID.into(),
        AMQPValue::LongString(aggregate_id.into()),
    );
    BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type(event_type.into())
        .with_content_type(wire::CONTENT_TYPE.into())
        .with_delivery_mode(wire::DELIVERY_MODE_PERSISTENT)
        .with_timestamp(created_at.timestamp().max(0) as u64)
        .with_app_id("outbox-relay".into())
        .with_headers(headers)
}

/// The loop's `BEGIN`, in the same round trip as the relay's.
/// Sequential scans off, as in the relay's: a plan made while the table
/// was empty (the latency runs start on one) otherwise reads the whole
/// heap, dead rows included, on every claim.
const ASYNC_COMMIT: &str =
    "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL enable_seqscan = off";

/// One batch on `conn`: `BEGIN`, claim up to `batch` due rows, publish
/// each with every confirm awaited after the whole batch, `DELETE` them,
/// `COMMIT`. Returns how many it published. With `stages`, records the
/// batch's moments there (`--latency-stages`).
async fn one_batch(
    conn: &mut sqlx::PgConnection,
    ch: &Channel,
    statements: &Statements,
    exchange: &str,
    batch: usize,
    stages: Option<&StageLog>,
) -> Result<usize> {
    let start = (std::time::Instant::now(), now_us());
    let opts = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    // The relay's design commits its batches without waiting for the WAL
    // flush (a lost commit only publishes again): so does its ceiling. A
    // plain BEGIN let the relay beat this loop (1.04 [1.02-1.08]).
    let mut tx = sqlx::Connection::begin_with(conn, statements.begin.clone()).await?;
    let begun = std::time::Instant::now();
    let rows = statements.claim(&mut tx, batch).await?;
    let claimed = std::time::Instant::now();
    if rows.is_empty() {
        tx.commit().await?;
        if let Some(log) = stages {
            let now = std::time::Instant::now();
            stages::record(log, start, [begun, claimed, claimed, claimed, now], vec![]);
        }
        return Ok(0);
    }
    anyhow::ensure!(
        rows.iter().all(|r| r.5 == "{}"),
        "the minimal loop publishes no event headers"
    );
    let publishes = rows
        .iter()
        .map(|r| {
            let key = wire::default_routing_key(&r.1, &r.3);
            ch.basic_publish(
                exchange.into(),
                key.as_str().into(),
                opts,
                r.4.as_bytes(),
                contract_properties(r.0, &r.1, &r.2, &r.3, r.6),
            )
        })
        .collect();
    let confirms = queue_all(publishes).await?;
    let handed = std::time::Instant::now();
    for c in confirms {
        let c = c.await?;
        anyhow::ensure!(c == Confirmation::Ack(None), "not acked: {c:?}");
    }
    let confirmed = std::time::Instant::now();
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    sqlx::query(statements.delete.clone())
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    if let Some(log) = stages {
        let ids = ids.iter().map(Uuid::to_string).collect();
        let now = std::time::Instant::now();
        stages::record(log, start, [begun, claimed, handed, confirmed, now], ids);
    }
    // After the settle's stamp, so its stage is the commit's alone.
    statements.burn(rows.len());
    Ok(rows.len())
}

/// One loop draining the backlog until a claim finds nothing; returns how
/// many events it published.
async fn drain_loop(
    pool: PgPool,
    ch: Channel,
    schema: String,
    exchange: String,
    batch: usize,
) -> Result<u64> {
    let statements = Statements::own(&schema);
    let mut conn = pool.acquire().await?;
    let mut sent = 0;
    loop {
        match one_batch(&mut conn, &ch, &statements, &exchange, batch, None).await? {
            0 => return Ok(sent),
            n => sent += n as u64,
        }
    }
}

/// The table's latency ceiling: `loops` loops that each claim at once
/// while rows are due and otherwise wait for the producers' wake-up
/// (`LISTEN` on the schema's channel, one listener for all) or the
/// relay's default poll interval, until `stop`. On its own runtime (two
/// workers, as the relay process has), so it does not share the
/// harness's threads, with its own connections: a connection opened on
/// this runtime dies with it, so it must not go back to the harness's
/// pool (one that did failed the next run with "a Tokio 1.x context was
/// found, but it is being shutdown"). With `stages`, each batch's
/// moments are recorded there. With a `burden` (microseconds of CPU per
/// event), the loops take on the relay's load without its path
/// (`--latency-hand-written-burden`): the relay's own `BEGIN` and claim,
/// and that much CPU burnt per event after each commit, when the events
/// are already on the queue.
#[allow(clippy::too_many_arguments)]
pub(crate) fn follow(
    database_url: String,
    url: String,
    schema: String,
    exchange: String,
    tuning: LoopTuning,
    burden: Option<u64>,
    stages: Option<StageLog>,
    stop: tokio_util::sync::CancellationToken,
) -> std::thread::JoinHandle<Result<()>> {
    on_own_runtime(async move {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(tuning.loops as u32 + 1)
            .connect(&database_url)
            .await?;
        let (wake, _) = tokio::sync::watch::channel(0u64);
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
        let ident = outbox::Ident::new("schema", &schema)?;
        listener.listen(&outbox::wakeup_channel(&ident)).await?;
        let listen = tokio::spawn({
            let wake = wake.clone();
            async move {
                while listener.recv().await.is_ok() {
                    while listener.next_buffered().is_some() {}
                    wake.send_modify(|g| *g = g.wrapping_add(1));
                }
            }
        });
        let statements = match burden {
            None => Statements::own(&schema),
            Some(us) => Statements::relays(&pool, &url, &schema, &exchange, us).await?,
        };
        let conn = connect_contender(&url).await?;
        let mut loops = Vec::new();
        for _ in 0..tuning.loops {
            let ch = confirm_channel(&conn).await?;
            let (pool, statements, exchange) = (pool.clone(), statements.clone(), exchange.clone());
            let (mut woken, stop) = (wake.subscribe(), stop.clone());
            let stages = stages.clone();
            loops.push(tokio::spawn(async move {
                let mut conn = pool.acquire().await?;
                while !stop.is_cancelled() {
                    woken.borrow_and_update();
                    let n = one_batch(
                        &mut conn,
                        &ch,
                        &statements,
                        &exchange,
                        tuning.batch,
                        stages.as_ref(),
                    )
                    .await?;
                    if n == 0 {
                        tokio::select! {
                            _ = woken.changed() => {}
                            _ = tokio::time::sleep(POLL) => {}
                            _ = stop.cancelled() => {}
                        }
                    }
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for l in loops {
            l.await??;
        }
        listen.abort();
        let _ = conn.close(200, "done".into()).await;
        pool.close().await;
        Ok(())
    })
}

/// The relay's default poll interval (`--poll-interval`).
const POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// The hand-written loops draining a backlog of `n` with `tuning`:
/// events/s between 5% and 100% of `n` published (timed on the queue, as
/// the relay is), and CPU seconds of broker, database and this process
/// over the same span.
pub(crate) async fn drain_rate(
    pool: &PgPool,
    url: &str,
    n: usize,
    tuning: LoopTuning,
) -> Result<(f64, (f64, f64, f64))> {
    let backlog = Backlog::new(pool, url, n, OrderedAggregates::None, 1_000).await?;
    let loops_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(tuning.loops as u32)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let conn = connect(url).await?;
    let cpu = CpuSpan::start(std::process::id());
    let mut tasks = Vec::new();
    for _ in 0..tuning.loops {
        let ch = confirm_channel(&conn).await?;
        tasks.push(tokio::spawn(drain_loop(
            loops_pool.clone(),
            ch,
            backlog.schema.clone(),
            backlog.name.clone(),
            tuning.batch,
        )));
    }
    let warm = (n / 20) as u64;
    let timed = backlog.time_fill(warm, n as u64).await;
    let cpu = cpu.stop();
    let mut sent = 0;
    for t in tasks {
        sent += t.await??;
    }
    let secs = timed?;
    anyhow::ensure!(sent == n as u64, "the loops published {sent} of {n}");
    backlog.verify(pool, n as u64).await?;
    let _ = conn.close(200, "done".into()).await;
    loops_pool.close().await;
    backlog.drop(pool).await?;
    Ok(((n as u64 - warm) as f64 / secs, cpu))
}

/// The fastest of [`LOOP_SWEEP`] on backlogs of `n` ([`sweep_best`]).
pub(crate) async fn sweep(pool: &PgPool, url: &str, n: usize) -> Result<(LoopTuning, f64)> {
    sweep_best("minimal loop", &LOOP_SWEEP, |tuning| async move {
        Ok(drain_rate(pool, url, n, tuning).await?.0)
    })
    .await
}
