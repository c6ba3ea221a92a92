//! Fault injection across the whole path: producer → outbox → relay →
//! RabbitMQ → dedup consumer → effect. Every fault is shown to have landed
//! on work in flight (a relay frozen holding row locks, a backend caught
//! in a statement or a transaction, a cut counted by the proxy, a confirm
//! timeout recorded by the relay), and only landed faults are counted.
//!
//! Every scenario ends with one oracle, judged only once everything is
//! quiet: the outbox is empty, every relay has stopped (a frozen relay's
//! late batch has landed by then), the consumer has emptied its queue and
//! stopped with nothing unacknowledged, and the wire counter has emptied
//! its own. Then the committed event ids must equal the applied effects,
//! none applied twice, every one on the wire, and (ordered cells) each
//! ordered aggregate applied in commit order. Duplicates on the wire are
//! counted; the fault-free scenarios assert there are none. The world and
//! its oracle are the ones the cluster and ordering suites use too
//! (`world/`).

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use e2e::cluster::Cluster;
use e2e::{
    Mode, Proxy, TestDb, amqp_url, freeze_mid_batch, kill_now, stop_child, suffix, wait_until,
};
use nix::sys::signal::Signal;
use outbox::{Capture, NewEvent, Outbox, OutboxConfig};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

mod world;

use world::{Broker, Committed, Counts, Options, World, deadline, scale, scaled};

/// Commits `n` events, `per_tx` per transaction, pausing `pace` between
/// transactions; returns the committed ids.
fn produce(
    db: &TestDb,
    n: usize,
    per_tx: usize,
    pace: Duration,
) -> tokio::task::JoinHandle<Vec<String>> {
    let db = db.clone();
    tokio::spawn(async move { db.produce(n, per_tx, pace).await })
}

/// Terminates the backends of `application_name` that are doing something
/// (running a statement or inside a transaction, not idle) and whose query
/// matches `query_like`; returns how many it terminated.
async fn terminate_busy_backends(pool: &PgPool, application_name: &str, query_like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE application_name = $1 AND query LIKE $2 AND state <> 'idle'
           AND pid <> pg_backend_pid()",
    )
    .bind(application_name)
    .bind(query_like)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn relay_sigkilled_mid_batch_repeatedly() {
    let w = World::new("f_kill").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    // A backlog, so every kill can land inside a batch, and more events
    // committed while the kills go on.
    let mut ids = produce(&w.db, scaled(20_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let producer = produce(&w.db, scaled(2_000), 20, Duration::from_millis(2));
    let outbox = format!("\"{}\".outbox", w.db.schema);
    let (mut landed, mut rounds) = (0, 0);
    let mut held = Vec::new();
    while landed < 8 && rounds < 20 {
        rounds += 1;
        let before = w.wire.distinct();
        let child = w.relay_process();
        wait_until(deadline(), "relay progress", || async {
            w.wire.distinct() > before
        })
        .await;
        // Kill only a relay caught holding a batch's row locks.
        let locked = freeze_mid_batch(&child, &w.db.pool, &outbox, 200).await;
        if locked > 0 {
            landed += 1;
            held.push(locked);
        }
        kill_now(child);
    }
    assert_eq!(
        landed, 8,
        "8 SIGKILLs landed inside a batch ({rounds} tries)"
    );
    ids.extend(producer.await.unwrap());
    let mut last = w.relay_process();
    w.outbox_drained().await;
    assert_eq!(
        stop_child(&mut last, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    w.judge(
        consumer,
        &ids,
        &format!("relay SIGKILLed {landed}x inside a batch holding {held:?} rows"),
    )
    .await;
    w.cleanup().await;
}

#[tokio::test]
async fn relay_sigstopped_holding_locks_while_a_second_relay_runs() {
    let w = World::new("f_stop").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let backlog = produce(&w.db, scaled(5_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let a = w.relay_process_with(&[("BATCH_SIZE", "500")]);
    // Stop relay A mid-batch: retry until the stop catches it holding row
    // locks (rows a SKIP LOCKED claim cannot see).
    let outbox = format!("\"{}\".outbox", w.db.schema);
    wait_until(deadline(), "relay A progress", || async {
        w.wire.distinct() > 0
    })
    .await;
    let locked = freeze_mid_batch(&a, &w.db.pool, &outbox, 200).await;
    assert!(locked > 0, "never caught relay A holding locks");
    // The second relay skips A's rows and keeps the rest flowing, more
    // events keep coming, and A's rows come free when its frozen session
    // times out (idle_in_transaction_session_timeout).
    let mut b = w.relay_process();
    let more = produce(&w.db, scaled(1_000), 20, Duration::from_millis(2))
        .await
        .unwrap();
    let mut ids = backlog;
    ids.extend(more);
    w.outbox_drained().await;
    // A resumes with its stale batch and may publish the rest of it: late
    // copies, which must land before the oracle judges. A graceful stop
    // returns only once its batch in flight has finished.
    let mut a = a;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.id() as i32), Signal::SIGCONT).unwrap();
    stop_child(&mut a, Signal::SIGINT, deadline()).await;
    assert_eq!(
        stop_child(&mut b, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    w.judge(
        consumer,
        &ids,
        &format!(
            "relay SIGSTOPped holding {locked} row locks, then SIGCONTed, beside a second relay"
        ),
    )
    .await;
    w.cleanup().await;
}

/// The log's reader SIGKILLed again and again mid-stream. A kill lands on
/// work in flight when the reader had published events whose position it
/// had not yet confirmed to the slot: the next reader publishes them
/// again. So after each kill the wire counter catches up and takes a
/// snapshot; the kill landed if an event of that snapshot arrives again
/// before the next one. Only such kills count. A round kills only a
/// reader that holds the slot and has published: with the wire counter's
/// prefetched messages taken for progress, kills landed on relays still
/// waiting for the killed one's session to end (7 of 30 landed).
/// Events keep being committed through every round, so no reader ever
/// sits idle with everything confirmed.
#[tokio::test]
async fn wal_relay_sigkilled_mid_stream_repeatedly() {
    let w = World::wal("f_wkill").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let mut ids = produce(&w.db, scaled(20_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let stop_producing = CancellationToken::new();
    let producer =
        w.db.produce_until(stop_producing.clone(), 20, Duration::from_millis(10));
    let conn = e2e::connect().await;
    let slot_held = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(w.db.slot())
        .fetch_one(&w.db.pool)
        .await
        .unwrap()
    };
    // What the wire counter holds once the killed reader's session is
    // gone, the queue is empty and the count has stopped moving (the
    // counter prefetches: an empty queue alone says little).
    let snapshot = || async {
        wait_until(deadline(), "the killed reader's session to end", || async {
            !slot_held().await
        })
        .await;
        let last = std::cell::Cell::new(usize::MAX);
        wait_until(deadline(), "the wire counter to catch up", || async {
            let total: usize = w.wire.received.lock().unwrap().counts.values().sum();
            e2e::depth(&conn, &w.wire_queue).await.0 == 0 && last.replace(total) == total
        })
        .await;
        w.wire.received.lock().unwrap().counts.clone()
    };
    let again = |before: &std::collections::HashMap<String, usize>,
                 now: &std::collections::HashMap<String, usize>| {
        before
            .iter()
            .any(|(id, n)| now.get(id).is_some_and(|m| m > n))
    };
    let (mut landed, mut rounds) = (0, 0);
    let mut at_kill = None;
    while landed < 8 && rounds < 30 {
        rounds += 1;
        let before = w.wire.distinct();
        let child = w.relay_process();
        wait_until(
            deadline(),
            "the relay reading the slot and publishing",
            || async { slot_held().await && w.wire.distinct() > before },
        )
        .await;
        kill_now(child);
        let now = snapshot().await;
        if at_kill.as_ref().is_some_and(|b| again(b, &now)) {
            landed += 1;
        }
        at_kill = Some(now);
    }
    stop_producing.cancel();
    let mut last = w.relay_process();
    ids.extend(producer.await.unwrap());
    w.outbox_drained().await;
    if at_kill
        .as_ref()
        .is_some_and(|b| again(b, &w.wire.received.lock().unwrap().counts))
    {
        landed += 1;
    }
    let _ = conn.close(200, "ok".into()).await;
    eprintln!("{landed} SIGKILLs landed in {rounds} tries");
    assert!(
        landed >= 8,
        "8 SIGKILLs landed on published, unconfirmed events ({landed} in {rounds} tries)"
    );
    assert_eq!(
        stop_child(&mut last, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    w.judge(
        consumer,
        &ids,
        &format!("the log's reader SIGKILLed {landed}x with published, unconfirmed events"),
    )
    .await;
    w.cleanup().await;
}

/// The log's reader frozen (SIGSTOP) mid-stream while a standby waits:
/// PostgreSQL ends the silent session after its sender timeout (3 s here),
/// the standby takes the slot and the stream goes on; the frozen relay,
/// thawed, finds its session gone and becomes the standby.
#[tokio::test]
async fn wal_relay_sigstopped_while_reading_a_standby_takes_over() {
    let w = World::wal("f_wstop").await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let backlog = produce(&w.db, scaled(5_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let name_a = format!("fault-relay-a-{}", suffix());
    let name_b = format!("fault-relay-b-{}", suffix());
    let reader = || async { w.db.slot_reader().await };
    let mut a = w.relay_process_with(&[("NAME", &name_a)]);
    wait_until(deadline(), "relay A reading", || async {
        reader().await == Some(format!("outbox-relay {name_a}")) && w.wire.distinct() > 0
    })
    .await;
    let mut b = w.relay_process_with(&[("NAME", &name_b)]);
    let producer = produce(&w.db, scaled(2_000), 20, Duration::from_millis(2));
    // Freeze A while events flow through it.
    let seen = w.wire.distinct();
    wait_until(deadline(), "events through relay A", || async {
        w.wire.distinct() > seen
    })
    .await;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.id() as i32), Signal::SIGSTOP).unwrap();
    let frozen = std::time::Instant::now();
    assert_eq!(
        reader().await,
        Some(format!("outbox-relay {name_a}")),
        "A held the slot when it froze"
    );
    wait_until(deadline(), "relay B taking the slot", || async {
        reader().await == Some(format!("outbox-relay {name_b}"))
    })
    .await;
    let handover = frozen.elapsed();
    let seen = w.wire.distinct();
    wait_until(deadline(), "events through relay B", || async {
        w.wire.distinct() > seen
    })
    .await;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.id() as i32), Signal::SIGCONT).unwrap();
    let mut ids = backlog;
    ids.extend(producer.await.unwrap());
    w.outbox_drained().await;
    stop_child(&mut a, Signal::SIGINT, deadline()).await;
    assert_eq!(
        stop_child(&mut b, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    w.judge(
        consumer,
        &ids,
        &format!(
            "the log's reader SIGSTOPped mid-stream: the standby read the slot {:.1} s later",
            handover.as_secs_f64()
        ),
    )
    .await;
    w.cleanup().await;
}

#[tokio::test]
async fn database_backends_of_relay_and_consumer_terminated() {
    let w = World::new("f_pgkill").await;
    let (relay_app, consumer_app) = (format!("r-{}", suffix()), format!("c-{}", suffix()));
    let relay = w.relay(&relay_app, amqp_url()).await;
    let consumer = w.consumer(&consumer_app).await;
    let producer = produce(&w.db, scaled(3_000), 20, Duration::from_millis(2));
    let (mut relay_kills, mut consumer_kills) = (0, 0);
    while !producer.is_finished() {
        relay_kills += terminate_busy_backends(&w.db.pool, &relay_app, "%").await;
        consumer_kills += terminate_busy_backends(&w.db.pool, &consumer_app, "%").await;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let ids = producer.await.unwrap();
    assert!(
        relay_kills > 0 && consumer_kills > 0,
        "busy backends terminated: relay {relay_kills}, consumer {consumer_kills}"
    );
    w.outbox_drained().await;
    relay.stop().await;
    w.judge(
        consumer,
        &ids,
        &format!("{relay_kills} busy relay and {consumer_kills} busy consumer backends terminated"),
    )
    .await;
    w.cleanup().await;
}

/// The consumer's link to the broker goes silent while it works: it
/// commits what it holds, and its acks vanish. Killed then (SIGKILL), it
/// leaves committed but unacknowledged deliveries; the broker redelivers
/// them to the next consumer, which must recognise them as duplicates.
#[tokio::test]
async fn consumer_sigkilled_between_commit_and_ack() {
    let w = World::new("f_ckill").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    // A backlog in the queue, and more events while the kills go on.
    let mut ids = produce(&w.db, scaled(3_000), 100, Duration::ZERO)
        .await
        .unwrap();
    let producer = produce(&w.db, scaled(2_000), 20, Duration::from_millis(2));
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let via_proxy = proxy.url(&amqp_url());
    let counts = Counts::default();
    let (mut landed, mut rounds) = (0, 0);
    while landed < 5 && rounds < 20 {
        rounds += 1;
        proxy.set(Mode::Pass);
        let (before, _) = w.effects().await;
        let child = w.consumer_process(&via_proxy, &counts);
        wait_until(deadline(), "consumer progress", || async {
            w.effects().await.0 > before
        })
        .await;
        proxy.set(Mode::Blackhole);
        let (at_blackhole, _) = w.effects().await;
        // Landed: a commit after the link went silent, so its ack is lost.
        let committed_unacked = tokio::time::timeout(Duration::from_secs(5), async {
            while w.effects().await.0 <= at_blackhole {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok();
        kill_now(child);
        landed += usize::from(committed_unacked);
    }
    assert_eq!(
        landed, 5,
        "5 kills landed between a commit and its ack ({rounds} tries)"
    );
    proxy.set(Mode::Pass);
    ids.extend(producer.await.unwrap());
    w.outbox_drained().await;
    relay.stop().await;
    let mut last = w.consumer_process(&amqp_url(), &counts);
    let conn = e2e::connect().await;
    wait_until(
        deadline(),
        "the last consumer to empty the queue",
        || async { e2e::depth(&conn, &w.broker.queue).await.0 == 0 },
    )
    .await;
    assert_eq!(
        stop_child(&mut last, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    let _ = conn.close(200, "ok".into()).await;
    let duplicates = counts.duplicates();
    assert!(
        duplicates > 0,
        "redeliveries of committed events were recognised as duplicates"
    );
    let spare = w.consumer(&format!("c-{}", suffix())).await;
    w.judge(
        spare,
        &ids,
        &format!(
            "consumer SIGKILLed {landed}x between commit and ack ({duplicates} duplicates \
             recognised)"
        ),
    )
    .await;
    proxy.stop();
    w.cleanup().await;
}

#[tokio::test]
async fn connection_cut_between_publish_and_confirm() {
    connection_cut(World::new("f_cut").await).await;
}

/// The same cuts with the events in the write-ahead log: a confirm
/// timeout puts the reader's events in the outbox table (where the
/// detection below finds them) and restarts its session.
#[tokio::test]
async fn wal_connection_cut_between_publish_and_confirm() {
    connection_cut(World::wal("f_wcut").await).await;
}

async fn connection_cut(w: World) {
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let relay = w
        .relay(&format!("r-{}", suffix()), proxy.url(&amqp_url()))
        .await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    // Events flow through every fault.
    let stop = CancellationToken::new();
    let producer =
        w.db.produce_until(stop.clone(), 20, Duration::from_millis(3));
    let faults = [
        Mode::CutAfter(3_000),
        Mode::Blackhole,
        Mode::Reset,
        Mode::CutAfter(20_000),
        Mode::Blackhole,
    ];
    let outbox = format!("\"{}\".outbox", w.db.schema);
    // The (event, attempt) pairs the relay recorded a confirm timeout for.
    let timed_out = || async {
        sqlx::query_as::<_, (uuid::Uuid, i32)>(AssertSqlSafe(format!(
            "SELECT id, attempts FROM {outbox} WHERE last_error = $1"
        )))
        .bind("no publisher confirm within the confirm timeout")
        .fetch_all(&w.db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect::<HashSet<_>>()
    };
    let mut blackholes = 0;
    for mode in faults {
        let seen = w.wire.distinct();
        wait_until(deadline(), "progress before the fault", || async {
            w.wire.distinct() > seen
        })
        .await;
        let (cuts, connections) = (proxy.cuts(), proxy.connections());
        // Each fault must land before the link comes back.
        match mode {
            Mode::CutAfter(_) => {
                proxy.set(mode);
                wait_until(deadline(), "the cut", || async { proxy.cuts() > cuts }).await
            }
            Mode::Reset => {
                proxy.set(mode);
                wait_until(deadline(), "a reconnect after the reset", || async {
                    proxy.connections() > connections
                })
                .await
            }
            // Publishes vanish and confirms never come: the relay's confirm
            // timeout (2 s) fires and it records that on the batch's rows.
            // A blackhole between two batches is noticed by the next
            // broker call instead (nothing in flight): try again.
            _ => {
                let before = timed_out().await;
                let mut landed = false;
                for _ in 0..20 {
                    // (WAL: events keep arriving, so a publish follows.)
                    if !w.is_wal() {
                        wait_until(deadline(), "a batch in flight", || async {
                            e2e::locked_rows(&w.db.pool, &outbox).await > 0
                        })
                        .await;
                    }
                    proxy.set(mode);
                    landed = tokio::time::timeout(Duration::from_secs(8), async {
                        while timed_out().await.is_subset(&before) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    })
                    .await
                    .is_ok();
                    if landed {
                        break;
                    }
                    proxy.set(Mode::Pass);
                    let seen = w.wire.distinct();
                    wait_until(deadline(), "progress after a missed blackhole", || async {
                        w.wire.distinct() > seen
                    })
                    .await;
                }
                assert!(
                    landed,
                    "no blackhole landed on a batch awaiting its confirms"
                );
                blackholes += 1;
            }
        }
        proxy.set(Mode::Pass);
    }
    stop.cancel();
    let ids = producer.await.unwrap();
    w.outbox_drained().await;
    relay.stop().await;
    w.judge(
        consumer,
        &ids,
        &format!(
            "broker connection cut {} ways while events flowed ({} cuts, {blackholes} \
             confirm timeouts, {} connections)",
            faults.len(),
            proxy.cuts(),
            proxy.connections()
        ),
    )
    .await;
    proxy.stop();
    w.cleanup().await;
}

#[tokio::test]
async fn relay_notification_connection_killed_polling_catches_up() {
    let w = World::new("f_listen").await;
    let app = format!("r-{}", suffix());
    let relay = w.relay(&app, amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let listening = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&app)
        .fetch_one(&w.db.pool)
        .await
        .unwrap()
            > 0
    };
    wait_until(deadline(), "the relay's LISTEN session", listening).await;
    let producer = produce(&w.db, scaled(1_000), 10, Duration::from_millis(5));
    let mut kills = 0;
    while !producer.is_finished() {
        // A LISTEN session is idle between notifications: any state.
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&app)
        .fetch_one(&w.db.pool)
        .await
        .unwrap();
        kills += killed;
        if killed > 0 {
            // The next kill lands on the relay's new session.
            wait_until(deadline(), "the relay to listen again", listening).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids = producer.await.unwrap();
    assert!(kills > 1, "the LISTEN session was terminated {kills}x");
    w.outbox_drained().await;
    relay.stop().await;
    let v = w
        .judge(
            consumer,
            &ids,
            &format!("LISTEN session terminated {kills}x"),
        )
        .await;
    assert_eq!(v.wire_duplicates, 0, "no publish failed: no copy");
    w.cleanup().await;
}

#[tokio::test]
async fn producer_transaction_committing_late_with_an_earlier_id() {
    let w = World::new("f_late").await;
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let ob = Outbox::new(&w.db.pool, {
        let mut c = OutboxConfig::default();
        c.schema = w.db.schema.to_string();
        c
    })
    .await
    .unwrap();
    // The late transaction takes its (earlier, time-ordered) id first...
    let mut late = w.db.pool.begin().await.unwrap();
    let early_id = ob
        .enqueue(
            &mut *late,
            NewEvent::new("order", "late", "OrderPlaced", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    // ...while later ids commit and are published first.
    let ids = produce(&w.db, scaled(500), 10, Duration::ZERO)
        .await
        .unwrap();
    wait_until(deadline(), "the later events", || async {
        w.effects().await.1 >= scaled(500) as i64
    })
    .await;
    assert!(
        ids.iter()
            .all(|id| id.as_str() > early_id.to_string().as_str()),
        "the late event's id sorts first"
    );
    ob.commit(late).await.unwrap();
    let mut all = ids;
    all.push(early_id.to_string());
    w.outbox_drained().await;
    relay.stop().await;
    let v = w
        .judge(
            consumer,
            &all,
            "a transaction committing late with an earlier id",
        )
        .await;
    assert_eq!(v.wire_duplicates, 0, "no fault: no copy");
    assert_eq!(v.events, all.len());
    w.cleanup().await;
}

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
    let mut ids = produce(&w.db, scaled(30_000), 500, Duration::ZERO)
        .await
        .unwrap();
    let relay = w.relay(&format!("r-{}", suffix()), amqp_url()).await;
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let producer = produce(&w.db, scaled(1_000), 20, Duration::from_millis(3));
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
    let ids = produce(&w.db, scaled(30_000), 500, Duration::ZERO)
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

// ---------------------------------------------------------------------------
// The matrix: every capability with every other. Each cell is one way a user
// deploys the toolkit (capture: the table or the log; producers: Rust or
// SQL; ordering off or on for one type), run with bad inputs mixed into the
// stream through that cell's producer path, the relay SIGKILLed on work in
// flight, duplicate deliveries injected into the consumer, and judged by
// the one oracle above once everything is quiet.
// ---------------------------------------------------------------------------

/// How a cell's producers write events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Producer {
    /// `Outbox::enqueue_many` (the table or the log, as the capture says).
    Rust,
    /// SQL, as another language would: `INSERT INTO outbox` (table) or
    /// `SELECT outbox_emit(..)` (log).
    Sql,
}

/// The aggregate type ordered cells order.
const ORDERED_TYPE: &str = "account";
/// The relay's payload limit in the matrix; a bad input goes over it.
const MATRIX_MAX_PAYLOAD: usize = 16 * 1024;

/// Event `i` of a cell: its aggregate (a third of them accounts).
fn cell_aggregate(i: usize) -> (&'static str, String) {
    if i.is_multiple_of(3) {
        (ORDERED_TYPE, format!("a-{}", i % 40))
    } else {
        ("order", format!("o-{}", i % 97))
    }
}

/// One event as a cell's producer writes it.
struct Spec {
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: String,
    exchange: Option<String>,
}

impl Spec {
    fn new(aggregate_type: &str, aggregate_id: &str, event_type: &str, payload: &str) -> Self {
        Self {
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            event_type: event_type.to_owned(),
            payload: payload.to_owned(),
            exchange: None,
        }
    }
}

/// Writes one event through the cell's producer path in `tx`; returns its
/// id, or the error that refused it.
async fn write_event(
    db: &TestDb,
    outbox: &Outbox,
    producer: Producer,
    tx: &mut PgConnection,
    e: &Spec,
) -> Result<String, String> {
    match producer {
        Producer::Rust => {
            let mut event = NewEvent::from_json(
                e.aggregate_type.clone(),
                e.aggregate_id.clone(),
                e.event_type.clone(),
                e.payload.clone(),
            )
            .map_err(|e| e.to_string())?;
            if let Some(x) = &e.exchange {
                event = event.exchange(x.clone());
            }
            outbox
                .enqueue(tx, event)
                .await
                .map(|id| id.to_string())
                .map_err(|e| e.to_string())
        }
        Producer::Sql => {
            let sql = if db.capture == Capture::Wal {
                format!(
                    "SELECT \"{}\".outbox_emit($1, $2, $3, $4::jsonb, '{{}}', $5)::text",
                    db.schema
                )
            } else {
                format!(
                    "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, event_type, payload, exchange)
                     VALUES ($1, $2, $3, $4::jsonb, $5) RETURNING id::text",
                    db.schema
                )
            };
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(&e.aggregate_type)
                .bind(&e.aggregate_id)
                .bind(&e.event_type)
                .bind(&e.payload)
                .bind(&e.exchange)
                .fetch_one(tx)
                .await
                .map_err(|e| e.to_string())
        }
    }
}

/// Commits good events through the cell's producer path, `per_tx` per
/// transaction with `pace` between them, until `stop`; returns
/// `(id, aggregate)` in commit order.
fn produce_cell(
    db: &TestDb,
    producer: Producer,
    per_tx: usize,
    pace: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Vec<(String, String)>> {
    let db = db.clone();
    tokio::spawn(async move {
        let outbox = db.outbox(db.capture).await;
        let mut committed = Vec::new();
        let mut i = 0;
        while !stop.is_cancelled() {
            let mut tx = db.pool.begin().await.unwrap();
            let mut this = Vec::with_capacity(per_tx);
            for _ in 0..per_tx {
                let (t, a) = cell_aggregate(i);
                let e = Spec::new(t, &a, "Happened", &format!("{{\"i\": {i}}}"));
                let id = write_event(&db, &outbox, producer, &mut tx, &e)
                    .await
                    .unwrap();
                this.push((id, format!("{t}/{a}")));
                i += 1;
            }
            tx.commit().await.unwrap();
            committed.extend(this);
            tokio::time::sleep(pace).await;
        }
        committed
    })
}

/// A bad input of a cell, and where it must end: refused at the door (the
/// producer's error) or dead-lettered, each with a reason containing
/// `reason`.
#[derive(Debug)]
struct Bad {
    what: &'static str,
    outcome: Result<String, String>,
    reason: &'static str,
}

/// Every kind of bad input the cell's producer path can write, each in a
/// transaction of its own between the good ones; `missing` is an exchange
/// that does not exist.
async fn write_bad_inputs(w: &World, producer: Producer, missing: &str) -> Vec<Bad> {
    let db = &w.db;
    let outbox = db.outbox(db.capture).await;
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(MATRIX_MAX_PAYLOAD + 1));
    let long = "E".repeat(300);
    let refused_name = match (producer, db.capture) {
        (Producer::Rust, _) => "255",
        (Producer::Sql, Capture::Wal) => "event_type is 300 bytes",
        (Producer::Sql, _) => "outbox_names_publishable",
    };
    let mut cases: Vec<(&'static str, Spec, &'static str)> = vec![
        (
            "event type over 255 bytes",
            Spec::new("order", "bad-1", &long, "{}"),
            refused_name,
        ),
        (
            "payload over the relay's limit",
            Spec::new("order", "bad-2", "Happened", &big),
            "over the relay's limit",
        ),
        (
            "exchange that does not exist",
            Spec {
                exchange: Some(missing.to_owned()),
                ..Spec::new("order", "bad-3", "Happened", "{}")
            },
            "does not exist",
        ),
    ];
    if producer == Producer::Sql && db.capture == Capture::Table {
        cases.push((
            "headers that are not an object",
            Spec::new("order", "bad-4", "Happened", "{}"),
            "outbox_headers",
        ));
    }
    let mut bad = Vec::new();
    for (what, event, reason) in cases {
        let mut tx = db.pool.begin().await.unwrap();
        let outcome = if what == "headers that are not an object" {
            sqlx::query_scalar::<_, String>(AssertSqlSafe(format!(
                "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                 VALUES ('order', 'bad-4', 'Happened', '{{}}', '[1]') RETURNING id::text",
                db.schema
            )))
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())
        } else {
            write_event(db, &outbox, producer, &mut tx, &event).await
        };
        if outcome.is_ok() {
            tx.commit().await.unwrap();
        }
        bad.push(Bad {
            what,
            outcome,
            reason,
        });
    }
    if db.capture == Capture::Wal {
        // What no producer of ours writes: text that is no event.
        sqlx::query("SELECT pg_logical_emit_message(true, $1, 'not an event')")
            .bind(format!("outbox:{}", db.schema))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    bad
}

/// Publishes copies of up to `n` events the wire saw straight into the
/// consumer's queue (same message id, properties and body): duplicate
/// deliveries the consumer must absorb. Returns how many it published.
async fn inject_duplicates(w: &World, n: usize) -> usize {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let copies: Vec<(lapin::BasicProperties, Vec<u8>)> = w
        .wire
        .received
        .lock()
        .unwrap()
        .first
        .values()
        .take(n)
        .map(|d| (d.properties.clone(), d.data.clone()))
        .collect();
    let conn = w.nodes.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for (props, body) in &copies {
        confirms.push(
            ch.basic_publish(
                "".into(),
                w.broker.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                props.clone(),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack(), "a duplicate was not taken");
    }
    let _ = conn.close(200, "ok".into()).await;
    copies.len()
}

/// The relay process SIGKILLed on work in flight while producers commit,
/// until `rounds` kills landed (at most eight times as many tries): the
/// table's relay caught holding a batch's row locks; the log's reader
/// after it published, landed when the next reader publishes some of it
/// again (it was published, not confirmed). Returns how many landed.
async fn kill_relays_in_flight(w: &World, rounds: usize) -> usize {
    let outbox = format!("\"{}\".outbox", w.db.schema);
    let mut landed = 0;
    // The log's reader: copies on the wire at the kill, to tell whether the
    // next reader published some again (the kill landed on published,
    // unconfirmed events; copies come before anything new, in log order).
    let mut copies_at_kill = None;
    for _ in 0..rounds * 8 {
        if landed >= rounds {
            break;
        }
        let before = w.wire.distinct();
        let child = w.relay_process_with(&MATRIX_RELAY);
        wait_until(deadline(), "the relay publishing", || async {
            w.wire.distinct() > before
        })
        .await;
        if w.is_wal() {
            if copies_at_kill.is_some_and(|c| w.wire.duplicates() > c) {
                landed += 1;
            }
            copies_at_kill = Some(w.wire.duplicates());
        } else if freeze_mid_batch(&child, &w.db.pool, &outbox, 200).await > 0 {
            landed += 1;
        }
        kill_now(child);
    }
    landed
}

/// The relay's settings in the matrix: a payload limit a bad input goes
/// over, and few, fast attempts for the one whose exchange is missing.
const MATRIX_RELAY: [(&str, &str); 4] = [
    ("MAX_PAYLOAD_BYTES", "16384"),
    ("MAX_ATTEMPTS", "3"),
    ("RETRY_BASE_MS", "100"),
    ("BATCH_SIZE", "50"),
];

/// The cluster cells: the relay's node stopped (gracefully) while it
/// publishes, and started again once publishing resumed on another node.
/// The relay is learnt from the node it records (`outbox_relays.broker`,
/// written at its lease rounds); only a session that failed on a node moves
/// it to the next, so its recording another node shows the stop landed on
/// its session. Returns what happened, for the cell's line.
async fn stop_the_relays_node(w: &World, cluster: &Cluster, cell: &str) -> String {
    let name = format!("fault-relay-node-{}", suffix());
    let mut env = MATRIX_RELAY.to_vec();
    env.push(("NAME", &name));
    let mut relay = w.relay_process_with(&env);
    let node_of_relay = || async {
        let recorded: Option<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT broker FROM \"{}\".outbox_relays WHERE name = $1 AND broker IS NOT NULL",
            w.db.schema
        )))
        .bind(&name)
        .fetch_optional(&w.db.pool)
        .await
        .unwrap();
        recorded.and_then(|b| cluster.node_at(&b))
    };
    let node = std::cell::Cell::new(None);
    wait_until(deadline(), &format!("{cell}: the relay's node"), || async {
        node.set(node_of_relay().await);
        node.get().is_some()
    })
    .await;
    let node = node.get().unwrap();
    // Work in flight: a batch holding rows (table), the log's reader
    // publishing (WAL); the producers go on committing throughout.
    let held = w.in_flight(0).await;
    eprintln!("{cell}: stopping node {node} at {}", chrono::Utc::now());
    let stopped_at = std::time::Instant::now();
    let moved = std::cell::Cell::new(None);
    // Publishing resumes while the node is still stopping: timed from the
    // stop's start, beside it.
    let (stopped, resumed) = tokio::join!(
        async {
            let stopped = cluster.stop_for_a_while(node).await.unwrap();
            (stopped, stopped_at.elapsed())
        },
        async {
            wait_until(
                deadline(),
                &format!("{cell}: the relay to move off node {node}"),
                || async {
                    moved.set(node_of_relay().await.filter(|m| *m != node));
                    moved.get().is_some()
                },
            )
            .await;
            let seen = w.wire.distinct();
            wait_until(
                deadline(),
                &format!("{cell}: publishing through node {:?}", moved.get()),
                || async { w.wire.distinct() > seen },
            )
            .await;
            stopped_at.elapsed()
        }
    );
    let (stopped, stop_took) = stopped;
    stopped.start().await.unwrap();
    assert_eq!(
        stop_child(&mut relay, Signal::SIGINT, deadline()).await,
        Some(0),
        "{cell}: the relay that lost its node did not stop cleanly"
    );
    format!(
        "relay's node {node} stopped ({:.1} s) with {} in flight: publishing through node {} \
         {:.1} s after the stop began",
        stop_took.as_secs_f64(),
        if w.is_wal() {
            "the log's reader publishing".to_owned()
        } else {
            format!("{held} rows left")
        },
        moved.get().unwrap(),
        resumed.as_secs_f64()
    )
}

/// Where a matrix cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum On {
    /// The test broker.
    Node,
    /// The three-node cluster, quorum queues, the relay's node stopped.
    Cluster,
}

async fn matrix_cell(capture: Capture, producer: Producer, ordered: bool, on: On) {
    let mut cell = format!(
        "{}/{:?}/{}",
        if capture == Capture::Wal {
            "wal"
        } else {
            "table"
        },
        producer,
        if ordered { "ordered" } else { "unordered" }
    );
    let mut prefix = format!(
        "m_{}{}{}",
        if capture == Capture::Wal { "w" } else { "t" },
        if producer == Producer::Sql { "s" } else { "r" },
        if ordered { "o" } else { "u" }
    );
    let nodes = match on {
        On::Node => Broker::Single,
        On::Cluster => {
            cell = format!("cluster {cell}");
            prefix = format!("c{prefix}");
            // The cells spread over the nodes: each starts its clients'
            // URL lists (so its relay, mostly) on a node of its own.
            let first = usize::from(capture == Capture::Wal)
                + usize::from(producer == Producer::Sql)
                + usize::from(ordered);
            Broker::on_cluster(first % 3)
        }
    };
    let db = match capture {
        Capture::Wal => TestDb::producer_wal(&prefix).await,
        _ => TestDb::producer(&prefix).await,
    };
    let options = Options {
        broker: nodes,
        ordered,
        ..Options::default()
    };
    let w = World::with(db, &prefix, options).await;
    if ordered {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT \"{}\".outbox_set_ordered($1, true)",
            w.db.schema
        )))
        .bind(ORDERED_TYPE)
        .execute(&w.db.pool)
        .await
        .unwrap();
    }
    // One cell of each capture runs with the xmin horizon held from
    // before its first event to after its oracle (a report left open in
    // the same database): no vacuum may remove a published row meanwhile.
    let held = if on == On::Node
        && !ordered
        && ((capture == Capture::Wal) == (producer == Producer::Rust))
    {
        cell = format!("{cell} (xmin horizon held)");
        Some(e2e::hold_snapshot(&w.db.pool.connect_options()).await)
    } else {
        None
    };
    let consumer = w.consumer(&format!("c-{}", suffix())).await;
    let stop_producing = CancellationToken::new();
    let producing = produce_cell(
        &w.db,
        producer,
        10,
        Duration::from_millis(5),
        stop_producing.clone(),
    );

    // Bad inputs while a relay publishes the good ones around them.
    let mut relay = w.relay_process_with(&MATRIX_RELAY);
    wait_until(deadline(), "the relay publishing", || async {
        w.wire.distinct() > 0
    })
    .await;
    let from = std::time::Instant::now();
    let missing = format!("{}.missing", w.broker.exchange);
    let bad = write_bad_inputs(&w, producer, &missing).await;
    let committed_bad: Vec<&Bad> = bad.iter().filter(|b| b.outcome.is_ok()).collect();
    let expected_dead = committed_bad.len() + usize::from(w.is_wal());
    wait_until(
        deadline(),
        &format!("{cell}: every bad input dead-lettered"),
        || async { w.db.count("outbox_dead_letters").await as usize >= expected_dead },
    )
    .await;
    let to = std::time::Instant::now();
    let gap = w.wire.received.lock().unwrap().longest_gap(from, to);
    assert_eq!(
        stop_child(&mut relay, Signal::SIGINT, deadline()).await,
        Some(0)
    );

    // The fault: relays SIGKILLed on work in flight while producers commit.
    let landed = kill_relays_in_flight(&w, 3 * scale()).await;
    let node_stopped = match w.nodes.cluster() {
        Some(cluster) => Some(stop_the_relays_node(&w, cluster, &cell).await),
        None => None,
    };
    stop_producing.cancel();
    let good = producing.await.unwrap();
    let mut last = w.relay_process_with(&MATRIX_RELAY);
    w.outbox_drained().await;
    let end = sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&w.db.pool)
        .await
        .unwrap();
    if w.is_wal() {
        wait_until(deadline(), &format!("{cell}: the slot past everything"), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(w.db.slot())
            .bind(&end)
            .fetch_one(&w.db.pool)
            .await
            .unwrap()
        })
        .await;
    }
    assert_eq!(
        stop_child(&mut last, Signal::SIGINT, deadline()).await,
        Some(0)
    );
    let injected = inject_duplicates(&w, 200).await;

    // The oracle checks each ordered aggregate's effects in commit order.
    let ids: Vec<String> = good.iter().map(|(id, _)| id.clone()).collect();
    let ordered_aggregates = good
        .iter()
        .filter(|(_, a)| ordered && a.starts_with(ORDERED_TYPE))
        .cloned();
    let verdict = w
        .judge(
            consumer,
            Committed::new(ids).in_order(ordered_aggregates),
            &format!("{cell}: {landed} kills in flight, {injected} duplicates injected"),
        )
        .await;
    assert!(
        landed > 0,
        "{cell}: no kill landed on work in flight (a batch holding rows; published, unconfirmed events of the log)"
    );

    // Every bad input accounted for, with its reason.
    let dead: Vec<(String, String, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id::text, event_type, last_error FROM \"{}\".outbox_dead_letters",
        w.db.schema
    )))
    .fetch_all(&w.db.pool)
    .await
    .unwrap();
    for b in &bad {
        match &b.outcome {
            Err(refused) => assert!(
                refused.contains(b.reason),
                "{cell}: {} refused without its reason: {refused}",
                b.what
            ),
            Ok(id) => {
                let letter = dead.iter().find(|(d, ..)| d == id);
                assert!(
                    letter.is_some_and(|(_, _, e)| e.contains(b.reason)),
                    "{cell}: {} ({id}) not dead-lettered with its reason: {letter:?}",
                    b.what
                );
            }
        }
    }
    if w.is_wal() {
        assert!(
            dead.iter()
                .any(|(_, t, e)| t == "(unreadable)" && e.contains("not an outbox event message")),
            "{cell}: the message that is no event was not dead-lettered: {dead:?}"
        );
    }
    assert_eq!(dead.len(), expected_dead, "{cell}: dead letters {dead:?}");
    if let Some(mut held) = held {
        let still: Option<String> = sqlx::query_scalar(
            "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(&mut held)
        .await
        .unwrap();
        assert!(still.is_some(), "{cell}: the snapshot was let go early");
        sqlx::raw_sql("ROLLBACK").execute(&mut held).await.unwrap();
    }
    assert!(
        gap < to - from,
        "{cell}: publishing paused for the whole time bad inputs were in flight ({gap:?})"
    );

    println!(
        "{cell}: {} good events, {} bad inputs ({} refused at the door), {landed} kills, \
         {injected} duplicates injected, {} copies on the wire, longest gap in publishing \
         while bad inputs were in flight {gap:?} of {:?}{}",
        verdict.events,
        bad.len() + usize::from(w.is_wal()),
        bad.len() - committed_bad.len(),
        verdict.wire_duplicates,
        to - from,
        node_stopped.map_or(String::new(), |n| format!("; {n}"))
    );
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

macro_rules! matrix {
    ($($name:ident, $cluster_name:ident: $capture:expr, $producer:expr, $ordered:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            matrix_cell($capture, $producer, $ordered, On::Node).await;
        }

        /// `make test` runs the `cluster_` tests alone, after the rest:
        /// they stop and start the cluster's nodes.
        #[tokio::test]
        async fn $cluster_name() {
            matrix_cell($capture, $producer, $ordered, On::Cluster).await;
        }
    )*};
}

matrix! {
    matrix_table_rust_unordered, cluster_matrix_table_rust_unordered:
        Capture::Table, Producer::Rust, false;
    matrix_table_rust_ordered, cluster_matrix_table_rust_ordered:
        Capture::Table, Producer::Rust, true;
    matrix_table_sql_unordered, cluster_matrix_table_sql_unordered:
        Capture::Table, Producer::Sql, false;
    matrix_table_sql_ordered, cluster_matrix_table_sql_ordered:
        Capture::Table, Producer::Sql, true;
    matrix_wal_rust_unordered, cluster_matrix_wal_rust_unordered:
        Capture::Wal, Producer::Rust, false;
    matrix_wal_rust_ordered, cluster_matrix_wal_rust_ordered:
        Capture::Wal, Producer::Rust, true;
    matrix_wal_sql_unordered, cluster_matrix_wal_sql_unordered:
        Capture::Wal, Producer::Sql, false;
    matrix_wal_sql_ordered, cluster_matrix_wal_sql_ordered:
        Capture::Wal, Producer::Sql, true;
}
