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
use std::time::Duration;

use e2e::{Mode, Proxy, amqp_url, freeze_mid_batch, kill_now, stop_child, suffix, wait_until};
use nix::sys::signal::Signal;
use outbox::{NewEvent, Outbox, OutboxConfig};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;

mod world;

use world::{Counts, World, deadline, scaled};

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
    let mut ids =
        w.db.spawn_produce(scaled(20_000), 500, Duration::ZERO)
            .await
            .unwrap();
    let producer =
        w.db.spawn_produce(scaled(2_000), 20, Duration::from_millis(2));
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
    let backlog =
        w.db.spawn_produce(scaled(5_000), 500, Duration::ZERO)
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
    let more =
        w.db.spawn_produce(scaled(1_000), 20, Duration::from_millis(2))
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
    let mut ids =
        w.db.spawn_produce(scaled(20_000), 500, Duration::ZERO)
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
    let backlog =
        w.db.spawn_produce(scaled(5_000), 500, Duration::ZERO)
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
    let producer =
        w.db.spawn_produce(scaled(2_000), 20, Duration::from_millis(2));
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
    let producer =
        w.db.spawn_produce(scaled(3_000), 20, Duration::from_millis(2));
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
    let mut ids =
        w.db.spawn_produce(scaled(3_000), 100, Duration::ZERO)
            .await
            .unwrap();
    let producer =
        w.db.spawn_produce(scaled(2_000), 20, Duration::from_millis(2));
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
    let producer =
        w.db.spawn_produce(scaled(1_000), 10, Duration::from_millis(5));
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
    let ids =
        w.db.spawn_produce(scaled(500), 10, Duration::ZERO)
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
