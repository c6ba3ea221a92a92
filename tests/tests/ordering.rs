//! Per-aggregate order end to end, under relay crashes: producers commit
//! events of 1,000 aggregates (each transaction bumps the aggregates'
//! versions under row locks, so version order is commit order); three
//! relay processes in ordered mode are SIGKILLed and restarted while they
//! publish; ordered consumers on four single-active-consumer partition
//! queues apply the events. Oracle (the fault suites' one, `world/`):
//! every committed event applied exactly once, for every aggregate the
//! applied versions are 1, 2, 3, ... in the order they were applied, each
//! aggregate's sequence numbers first arrive on the wire in order, and the
//! outbox is empty.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use e2e::{KillOnDrop, TestDb, kill_now, suffix, wait_until};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use outbox::{NewEvent, OrderedAggregates, Outbox, OutboxConfig};
use serde_json::json;
use sqlx::AssertSqlSafe;

mod world;

use world::{Committed, Options, World};

const AGGREGATES: usize = 1_000;
const PER_TX: usize = 10;
const WRITERS: usize = 8;
const DEADLINE: Duration = Duration::from_secs(300);
/// The relay processes' settings beside the world's.
const RELAY: [(&str, &str); 2] = [("BATCH_SIZE", "200"), ("LEASE_TTL_MS", "1000")];

/// Events committed in total (50,000 by default; `FAULT_SCALE` multiplies).
fn events() -> usize {
    50_000 * world::scale()
}

/// One scenario's world: the ordered topology (four single-active-consumer
/// partition queues, one ordered consumer each), the wire watched for each
/// aggregate's order, and the producer schema's accounts (`wal`: the
/// events in the write-ahead log).
async fn world(prefix: &str, wal: bool) -> World {
    let db = if wal {
        TestDb::producer_wal(prefix).await
    } else {
        TestDb::producer(prefix).await
    };
    let options = Options {
        ordered: true,
        partitions: Some(4),
        wire_order: true,
        deadline: DEADLINE,
        ..Options::default()
    };
    let w = World::with(db, prefix, options).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{s}\".accounts (id text PRIMARY KEY, version bigint NOT NULL DEFAULT 0);
         INSERT INTO \"{s}\".accounts (id) SELECT 'acc-' || i FROM generate_series(0, {last}) i;",
        s = w.db.schema,
        last = AGGREGATES - 1
    )))
    .execute(&w.db.pool)
    .await
    .unwrap();
    w
}

/// A relay process whose relay name and database application name are
/// `name`.
fn relay_named(w: &World, name: &str) -> KillOnDrop {
    w.relay_process_with(&[("NAME", name), RELAY[0], RELAY[1]])
}

/// An event committed: its id, aggregate and the aggregate's version it
/// carries.
type Produced = (String, String, i64);

/// Commits `n` events from `WRITERS` concurrent writers: each transaction
/// bumps the version of `PER_TX` aggregates (locking their rows) and
/// enqueues one event per aggregate carrying the new version; each writer
/// pauses `pace` between transactions. Returns the events committed.
async fn produce(db: &TestDb, n: usize, pace: Duration) -> Vec<Produced> {
    outbox::set_ordered(&db.pool, &db.schema, "account", true)
        .await
        .unwrap();
    let outbox = Outbox::new(&db.pool, {
        let mut c = OutboxConfig::default();
        c.schema = db.schema.to_string();
        c.ordering = OrderedAggregates::types(["account"]);
        c.capture = db.capture;
        c
    })
    .await
    .unwrap();
    // Rows locked in key order: concurrent writers cannot deadlock.
    let bump = format!(
        "WITH l AS (SELECT id FROM \"{s}\".accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE)
         UPDATE \"{s}\".accounts a SET version = a.version + 1 FROM l WHERE a.id = l.id
         RETURNING a.id, a.version",
        s = db.schema
    );
    let transactions = n / PER_TX;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, outbox, bump) = (db.pool.clone(), outbox.clone(), bump.clone());
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for k in (w..transactions).step_by(WRITERS) {
                let ids: Vec<String> = (0..PER_TX)
                    .map(|j| format!("acc-{}", (k * 37 + j * 101) % AGGREGATES))
                    .collect();
                let mut tx = pool.begin().await.unwrap();
                let mut bumped: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(bump.clone()))
                    .bind(&ids)
                    .fetch_all(&mut *tx)
                    .await
                    .unwrap();
                bumped.sort();
                let events = bumped.iter().map(|(id, version)| {
                    NewEvent::new("account", id, "Changed", &json!({ "version": version })).unwrap()
                });
                let event_ids = outbox.enqueue_many(&mut *tx, events).await.unwrap();
                outbox.commit(tx).await.unwrap();
                committed.extend(
                    event_ids
                        .into_iter()
                        .zip(bumped)
                        .map(|(e, (a, v))| (e.to_string(), a, v)),
                );
                if !pace.is_zero() {
                    tokio::time::sleep(pace).await;
                }
            }
            committed
        }));
    }
    let mut committed = Vec::new();
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    committed
}

fn spawn_produce(w: &World, n: usize, pace: Duration) -> tokio::task::JoinHandle<Vec<Produced>> {
    let db = w.db.clone();
    tokio::spawn(async move { produce(&db, n, pace).await })
}

/// What the oracle expects of the `n` events `produced`: every one
/// applied once, each aggregate's in version order (each transaction
/// bumps the versions under row locks, so version order is commit order).
/// The versions are checked against the accounts first: every aggregate
/// touched, its versions 1, 2, ..., its final one, each once.
async fn committed(w: &World, n: usize, produced: Vec<Produced>) -> Committed {
    assert_eq!(produced.len(), n, "every event committed");
    let finals: HashMap<String, i64> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, version FROM \"{}\".accounts",
        w.db.schema
    )))
    .fetch_all(&w.db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let mut produced = produced;
    produced.sort_by(|a, b| (&a.1, a.2).cmp(&(&b.1, b.2)));
    let mut versions: HashMap<&str, Vec<i64>> = HashMap::new();
    for (_, a, v) in &produced {
        versions.entry(a.as_str()).or_default().push(*v);
    }
    let touched = finals.values().filter(|v| **v > 0).count();
    assert_eq!(versions.len(), touched, "every aggregate touched committed");
    for (aggregate, vs) in &versions {
        let expected: Vec<i64> = (1..=finals[*aggregate]).collect();
        assert_eq!(vs, &expected, "{aggregate}: the versions committed");
    }
    let ids = produced.iter().map(|(id, ..)| id.clone()).collect();
    Committed::new(ids).in_order(produced.into_iter().map(|(id, a, _)| (id, a)))
}

/// Unexpired partition leases held by the relay named `name`.
async fn leases_of(w: &World, name: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".outbox_leases WHERE owner_name = $1 AND expires_at > now()",
        w.db.schema
    )))
    .bind(name)
    .fetch_one(&w.db.pool)
    .await
    .unwrap()
}

/// Whether the relay named `name` has a database session inside a write
/// transaction: caught in a batch (claimed, not yet settled).
async fn in_batch(db: &TestDb, name: &str) -> bool {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
         AND state IN ('idle in transaction', 'active') AND backend_xid IS NOT NULL",
    )
    .bind(name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
        > 0
}

/// Freezes `child` (SIGSTOP) until a freeze catches the relay `name`
/// inside a batch; returns whether one did (the child stays frozen), or
/// leaves it running after `attempts`.
async fn freeze_in_batch(db: &TestDb, child: &KillOnDrop, name: &str, attempts: u64) -> bool {
    let pid = Pid::from_raw(child.id() as i32);
    for attempt in 0..attempts {
        kill(pid, Signal::SIGSTOP).unwrap();
        if in_batch(db, name).await {
            return true;
        }
        kill(pid, Signal::SIGCONT).unwrap();
        tokio::time::sleep(Duration::from_millis((attempt * 7) % 13)).await;
    }
    false
}

/// SIGKILLs that must land inside a batch (README: the guarantees table).
const LANDED_KILLS: usize = 20;

#[tokio::test]
async fn three_relays_killed_and_restarted_keep_every_aggregate_in_commit_order() {
    let n = events();
    let w = world("ord_e2e", false).await;
    let consumers = w.consumers().await;
    let started = Instant::now();
    let mut relays = w.named_relays(3, &RELAY);
    let producer = spawn_produce(&w, n, Duration::ZERO);
    // Kill one relay at a time, at staggered moments, each kill caught
    // inside one of its batches, and start a fresh one in its place, until
    // enough kills landed and the producers are done.
    let (mut landed, mut tries) = (0, 0);
    let mut round = 0u64;
    while landed < LANDED_KILLS || !producer.is_finished() {
        tokio::time::sleep(Duration::from_millis(200 + (round * 173) % 400)).await;
        round += 1;
        if w.db.count("outbox").await == 0 {
            if producer.is_finished() {
                break;
            }
            continue;
        }
        let victim = (round as usize) % relays.len();
        tries += 1;
        if freeze_in_batch(&w.db, &relays[victim].1, &relays[victim].0, 100).await {
            landed += 1;
        }
        let fresh = w.named_relay(&RELAY);
        let (_, child) = std::mem::replace(&mut relays[victim], fresh);
        kill_now(child);
    }
    let produced = producer.await.unwrap();
    assert!(
        landed >= LANDED_KILLS,
        "{landed} of {tries} SIGKILLs landed inside a batch before the outbox drained"
    );
    w.outbox_drained().await;
    for (_, r) in relays {
        kill_now(r);
    }
    let duplicates = w
        .judge(
            consumers,
            committed(&w, n, produced).await,
            &format!("ordered: 3 relays, {landed} of {tries} SIGKILLs inside a batch"),
        )
        .await
        .wire_duplicates;
    println!(
        "ordered e2e: {n} events over {AGGREGATES} aggregates, 3 relays, {tries} SIGKILLs \
         ({landed} inside a batch); {duplicates} duplicates on the wire; every aggregate \
         published and applied in commit order; {:?}",
        started.elapsed()
    );
    w.cleanup().await;
}

/// The same order from the write-ahead log: two relays, one reading the
/// slot and one standby; the reader is SIGKILLed again and again while
/// the producers commit (the standby takes over, a fresh standby is
/// started), so every kill makes the next reader publish again what was
/// not confirmed to the slot. No sequence-number claim is involved: the
/// log is read in commit order. The ordered consumers must apply every
/// aggregate in commit order, each event once, and the wire must carry
/// each aggregate's numbers first in order.
#[tokio::test]
async fn wal_reader_killed_again_and_again_keeps_every_aggregate_in_commit_order() {
    let n = events() / 2;
    let w = world("ord_wal", true).await;
    let consumers = w.consumers().await;
    let started = Instant::now();
    let reader = || async { w.db.slot_reader().await };
    let mut relays = w.named_relays(2, &RELAY);
    let producer = spawn_produce(&w, n, Duration::from_millis(5));
    let (mut kills, mut at_last_kill) = (0, 0);
    let mut round = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(200 + (round * 173) % 400)).await;
        round += 1;
        let published = w
            .wire_seqs()
            .first_arrivals()
            .0
            .values()
            .map(Vec::len)
            .sum::<usize>();
        if producer.is_finished() && (kills >= 6 || published >= n) {
            break;
        }
        // Kill the reader while it reads: it holds the slot and the wire
        // has moved since the last kill.
        if published == at_last_kill || kills >= 12 {
            continue;
        }
        let Some(holder) = reader().await else {
            continue;
        };
        let Some(victim) = relays
            .iter()
            .position(|(name, _)| holder == format!("outbox-relay {name}"))
        else {
            continue;
        };
        let fresh = w.named_relay(&RELAY);
        let (_, child) = std::mem::replace(&mut relays[victim], fresh);
        kill_now(child);
        kills += 1;
        at_last_kill = published;
    }
    let produced = producer.await.unwrap();
    assert!(kills >= 6, "only {kills} SIGKILLs of a reader publishing");
    w.db.drained(DEADLINE).await;
    for (_, r) in relays {
        kill_now(r);
    }
    let duplicates = w
        .judge(
            consumers,
            committed(&w, n, produced).await,
            &format!("ordered from the log: the reader SIGKILLed {kills}x"),
        )
        .await
        .wire_duplicates;
    println!(
        "ordered e2e from the log: {n} events over {AGGREGATES} aggregates, the reader \
         SIGKILLed {kills}x; {duplicates} duplicates on the wire; every aggregate published \
         and applied in commit order; {:?}",
        started.elapsed()
    );
    w.cleanup().await;
}

/// A relay frozen (SIGSTOP) inside a batch keeps its partitions only until
/// PostgreSQL ends its transaction (confirm + broker timeouts + 5 s: 11 s
/// for the test relay) and its leases expire (1 s); the other relay takes them over and goes on; when the
/// frozen one resumes, whatever it still had queued can only arrive as a
/// stale copy. Order holds on the wire and at the consumer.
#[tokio::test]
async fn a_frozen_relay_cannot_publish_out_of_order_when_it_resumes() {
    let n = events() / 5;
    let w = world("ord_stop", false).await;
    let consumers = w.consumers().await;
    let (frozen_name, other_name) = (
        format!("frozen-{}", suffix()),
        format!("other-{}", suffix()),
    );
    let frozen = relay_named(&w, &frozen_name);
    let other = relay_named(&w, &other_name);
    let producer = spawn_produce(&w, n, Duration::from_millis(40));
    let frozen_pid = Pid::from_raw(frozen.id() as i32);
    // The frozen relay's database session inside a transaction: caught
    // mid-batch, holding its partitions' lease rows.
    let in_batch = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
             AND state IN ('idle in transaction', 'active') AND backend_xid IS NOT NULL",
        )
        .bind(&frozen_name)
        .fetch_one(&w.db.pool)
        .await
        .unwrap()
            > 0
    };
    let mut caught = 0;
    let mut takeovers = Vec::new();
    for round in 0..2u64 {
        wait_until(DEADLINE, "the frozen relay to hold partitions", || async {
            leases_of(&w, &frozen_name).await > 0
        })
        .await;
        // Freeze it, until a freeze lands inside one of its batches.
        let mut inside = false;
        for attempt in 0..200u64 {
            kill(frozen_pid, Signal::SIGSTOP).unwrap();
            if in_batch().await {
                inside = true;
                break;
            }
            kill(frozen_pid, Signal::SIGCONT).unwrap();
            tokio::time::sleep(Duration::from_millis((attempt * 7 + round) % 13)).await;
        }
        if inside {
            caught += 1;
            let frozen_at = Instant::now();
            // The other relay takes every partition over while this one
            // is frozen, and keeps publishing.
            wait_until(
                DEADLINE,
                "the other relay to hold all 64 partitions",
                || async { leases_of(&w, &other_name).await == 64 },
            )
            .await;
            takeovers.push(frozen_at.elapsed());
            kill(frozen_pid, Signal::SIGCONT).unwrap();
        }
    }
    assert!(caught > 0, "no freeze landed inside a batch");
    let produced = producer.await.unwrap();
    w.outbox_drained().await;
    // Both stop gracefully: whatever the frozen one still had queued has
    // landed before the oracle judges.
    let (mut frozen, mut other) = (frozen, other);
    for r in [&mut frozen, &mut other] {
        assert_eq!(
            e2e::stop_child(r, Signal::SIGINT, DEADLINE).await,
            Some(0),
            "a graceful stop"
        );
    }
    let duplicates = w
        .judge(
            consumers,
            committed(&w, n, produced).await,
            &format!("ordered: a relay frozen inside a batch {caught}x beside a second relay"),
        )
        .await
        .wire_duplicates;
    println!(
        "ordered e2e: {n} events; a relay frozen inside a batch {caught}x beside a second relay, \
         which took its partitions over after {takeovers:?}; {duplicates} duplicates on the \
         wire; order held"
    );
    w.cleanup().await;
}
