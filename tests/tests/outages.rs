//! Faults that restart or silence a service while work is in flight: the
//! broker restarted and its connections force-closed, PostgreSQL crashed
//! and restarted in immediate mode, a database link gone silent for
//! minutes under the relay and under the consumer. Judged by the fault
//! suites' one oracle (`world/`), once everything is quiet.

use std::process::Command;
use std::time::Duration;

use e2e::{Mode, Proxy, TestDb, amqp_url, stop_child, suffix, wait_until};
use nix::sys::signal::Signal;
use outbox::Capture;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

mod world;

use world::{Committed, Options, World, deadline, scaled};

/// Restarts the shared broker and closes every connection, each time with
/// a backlog in flight: run alone (`make test` runs `disruptive_` tests
/// after the others).
#[tokio::test]
async fn disruptive_broker_restart_and_forced_connection_close() {
    broker_restart(World::new("f_brk").await).await;
}

#[tokio::test]
async fn disruptive_wal_broker_restart_and_forced_connection_close() {
    broker_restart(World::wal("f_wbrk").await).await;
}

async fn broker_restart(w: World) {
    let mut ids =
        w.db.spawn_produce(scaled(30_000), 500, Duration::ZERO)
            .await
            .unwrap();
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let producer =
        w.db.spawn_produce(scaled(1_000), 20, Duration::from_millis(3));
    let backlog = ids.len();
    let in_flight = || async {
        let left = w.in_flight(backlog).await;
        assert!(
            left > 500,
            "the backlog drained before the fault ({left} left)"
        );
        left
    };
    let first = in_flight().await;
    let ok = Command::new("rabbitmqctl")
        .args(["close_all_connections", "fault test"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "rabbitmqctl close_all_connections failed");
    let seen = w.wire.distinct();
    wait_until(deadline(), "progress after the forced close", || async {
        w.wire.distinct() > seen
    })
    .await;
    let second = in_flight().await;
    let ok = Command::new("rabbitmqctl")
        .arg("stop_app")
        .status()
        .unwrap()
        .success()
        && Command::new("rabbitmqctl")
            .arg("start_app")
            .status()
            .unwrap()
            .success();
    assert!(ok, "rabbitmqctl could not restart the broker");
    ids.extend(producer.await.unwrap());
    w.outbox_drained().await;
    relay.stop().await;
    w.judge(
        consumer,
        &ids,
        &format!(
            "broker connections force-closed with {first} events left, then the broker \
             restarted with {second} left"
        ),
    )
    .await;
    w.cleanup().await;
}

/// Restarts the shared PostgreSQL cluster in immediate mode: no shutdown
/// checkpoint, every backend killed, crash recovery from the WAL on start.
fn restart_postgres_immediately() {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("a Debian PostgreSQL cluster under /etc/postgresql")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .max_by_key(|v| v.parse::<u32>().unwrap_or(0))
        .expect("a PostgreSQL version");
    let ok = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            "immediate",
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok, "pg_ctlcluster could not restart PostgreSQL");
}

/// PostgreSQL crashes (an immediate-mode restart: crash recovery) while
/// the relay holds a batch and the consumer applies. Both recover by
/// themselves; the relay's unflushed bookkeeping (it commits with
/// `synchronous_commit = off`) may make it publish again what it had
/// published, which the consumer recognises. The consumer's commits are
/// synchronous, so no acked effect is lost. Runs alone: it restarts the
/// shared database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disruptive_postgres_crash_restart() {
    postgres_crash(World::new("f_pgc").await).await;
}

/// The same crash with the events in the write-ahead log: the replication
/// session dies with the server; the reader reconnects and reads again
/// from the slot's confirmed position (which the crash may set back:
/// copies only).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disruptive_wal_postgres_crash_restart() {
    postgres_crash(World::wal("f_wpgc").await).await;
}

async fn postgres_crash(w: World) {
    let ids =
        w.db.spawn_produce(scaled(30_000), 500, Duration::ZERO)
            .await
            .unwrap();
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    // Lands on work in flight: a relay batch holds rows (or, WAL, the
    // reader is publishing) and the consumer has applied some but not all.
    wait_until(deadline(), "the consumer applying", || async {
        w.effects().await.1 > 0
    })
    .await;
    let left = w.in_flight(ids.len()).await;
    let (_, applied) = w.effects().await;
    assert!(
        (applied as usize) < ids.len(),
        "the consumer applied everything before the crash"
    );
    assert!(
        left > 1_000,
        "the backlog drained before the crash ({left} left)"
    );
    let (_, applied_before) = w.effects().await;
    let crashed = std::time::Instant::now();
    restart_postgres_immediately();
    let restart_took = crashed.elapsed();
    let restarted = std::time::Instant::now();
    let published_before = w.wire.distinct();
    // Counting may fail while the database recovers.
    let applied_now = || async {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT count(DISTINCT event_id) FROM \"{}\".effects",
            w.consumer_schema
        )))
        .fetch_one(&w.db.pool)
        .await
        .ok()
    };
    let relay_back = std::cell::Cell::new(None);
    let consumer_back = std::cell::Cell::new(None);
    wait_until(
        deadline(),
        "relay and consumer to resume by themselves",
        || async {
            if relay_back.get().is_none() && w.wire.distinct() > published_before {
                relay_back.set(Some(restarted.elapsed()));
            }
            if consumer_back.get().is_none()
                && applied_now().await.is_some_and(|n| n > applied_before)
            {
                consumer_back.set(Some(restarted.elapsed()));
            }
            relay_back.get().is_some() && consumer_back.get().is_some()
        },
    )
    .await;
    let (relay_back, consumer_back) = (relay_back.get(), consumer_back.get());
    w.outbox_drained().await;
    relay.stop().await;
    let v = w
        .judge(
            consumer,
            &ids,
            &format!(
                "PostgreSQL restarted in immediate mode ({:.1} s) with {left} events in the \
                 outbox: publishing resumed {:.1} s after it was back, applying {:.1} s after",
                restart_took.as_secs_f64(),
                relay_back.unwrap().as_secs_f64(),
                consumer_back.unwrap().as_secs_f64()
            ),
        )
        .await;
    assert_eq!(v.events, ids.len());
    w.cleanup().await;
}

/// The matrix's silent-link cell of one capture: a relay process whose
/// database link goes silent (no RST) while events flow, for every
/// connection, old and new, for a while; then heals for new connections
/// only, the old ones dead for good. The relay notices within its
/// database timeout, discards what went silent and carries on on fresh
/// connections; the oracle finds every event applied once.
async fn silent_database_link_cell(capture: Capture) {
    let (cell, db) = match capture {
        Capture::Wal => ("wal/silent link", TestDb::producer_wal("m_sw").await),
        _ => ("table/silent link", TestDb::producer("m_st").await),
    };
    let w = World::with(db, "m_s", Options::default()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let through_proxy = proxy.url(&e2e::database_url());
    let mut relay = w.relay_process_with(&[("DATABASE_URL", &through_proxy)]);
    let stop_producing = CancellationToken::new();
    let producing =
        w.db.produce_until(stop_producing.clone(), 5, Duration::from_millis(20));
    wait_until(deadline(), "the relay publishing", || async {
        w.wire.distinct() > 200
    })
    .await;
    proxy.set(Mode::Blackhole);
    // The fault lasts: several of the relay's database timeouts (3 s), the
    // server's own bounds on a transaction left open included.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = w.wire.distinct();
    let healed = std::time::Instant::now();
    proxy.set(Mode::Silent);
    wait_until(deadline(), &format!("{cell}: publishing again"), || async {
        w.wire.distinct() > before
    })
    .await;
    let resumed = healed.elapsed();
    stop_producing.cancel();
    let ids = producing.await.unwrap();
    w.outbox_drained().await;
    assert_eq!(
        stop_child(&mut relay, Signal::SIGINT, deadline()).await,
        Some(0),
        "{cell}: a clean stop"
    );
    let dead = proxy.dead();
    let verdict = w
        .judge(
            consumer,
            Committed::new(ids),
            &format!("{cell}: {dead} connections left dead"),
        )
        .await;
    assert!(
        dead > 0,
        "{cell}: no connection of the relay's was on the link"
    );
    assert!(
        resumed <= Duration::from_secs(5),
        "{cell}: publishing resumed {resumed:?} after the heal"
    );
    println!(
        "{cell}: {} events, {dead} connections left dead, publishing resumed {resumed:?} after the heal, {} copies on the wire",
        verdict.events, verdict.wire_duplicates
    );
    proxy.stop();
    w.cleanup().await;
}

/// A consumer whose database link goes silent (no RST) while it applies
/// events: its batch's round trips are bounded from its side, the silent
/// connection is closed, never pooled again, and the batch (nothing acked)
/// waited out; once new connections pass, it goes on. Every effect once.
#[tokio::test]
async fn consumer_database_link_goes_silent() {
    let w = World::new("f_csilent").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    // Its round trips bounded by 4 s (lock wait 2 s + 2 s), 6 s after a
    // handler call.
    let consumer = w.consumer_through(&proxy.url(&e2e::database_url()), |c| {
        c.database_timeout = Duration::from_secs(2);
        c.lock_timeout = Duration::from_secs(2);
        c.handler_timeout = Duration::from_secs(2);
    });
    let effects = || async { w.effects().await.0 };
    let stop_producing = CancellationToken::new();
    let producing =
        w.db.produce_until(stop_producing.clone(), 5, Duration::from_millis(20));
    wait_until(deadline(), "the consumer applying", || async {
        effects().await > 200
    })
    .await;
    proxy.set(Mode::Blackhole);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = effects().await;
    let healed = std::time::Instant::now();
    proxy.set(Mode::Silent);
    wait_until(deadline(), "the consumer applying again", || async {
        effects().await > before
    })
    .await;
    let resumed = healed.elapsed();
    stop_producing.cancel();
    let ids = producing.await.unwrap();
    w.outbox_drained().await;
    relay.stop().await;
    let dead = proxy.dead();
    let verdict = w
        .judge(
            consumer,
            Committed::new(ids),
            &format!("consumer's database link silent: {dead} connections left dead"),
        )
        .await;
    assert!(dead > 0, "no connection of the consumer's was on the link");
    // A bound, a pause and a batch: without the bounds it waited for the
    // server's own timeouts (20 s here), or the kernel's.
    assert!(
        resumed <= Duration::from_secs(10),
        "the consumer applied again only {resumed:?} after the heal"
    );
    println!(
        "consumer's database link silent: {} events, {dead} connections left dead, applying again {resumed:?} after the heal",
        verdict.events
    );
    proxy.stop();
    w.cleanup().await;
}

#[tokio::test]
async fn matrix_table_silent_database_link() {
    silent_database_link_cell(Capture::Table).await;
}

#[tokio::test]
async fn matrix_wal_silent_database_link() {
    silent_database_link_cell(Capture::Wal).await;
}
