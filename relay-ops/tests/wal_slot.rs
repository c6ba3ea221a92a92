//! The write-ahead-log capture's slot: it moves past an event only once
//! the event is delivered or recorded in the table, whatever is on the
//! wire, nacked or timed out; ordered aggregates wait their turn; a
//! standby takes the slot over. Each test has its own schema, slot,
//! exchange and queue.

use std::time::{Duration, Instant};

use e2e::wal::{commit_events, confirmed_past, position, reports};
use e2e::{Collector, SeqLog, TestBroker, TestDb, TestRelay, amqp_url, wait_until};
use lapin::types::FieldTable;
use outbox::{Capture, NewEvent};
use outbox_relay::RelayConfig;
use serde_json::json;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(60);

/// The slot moves past an event only once it is delivered or recorded:
/// while the outbox table is locked, the reader cannot record an event it
/// failed to deliver, and the slot's confirmed position stays before it,
/// report after report; once the lock goes, the event is in the table and
/// the slot moves on.
#[tokio::test]
async fn wal_slot_moves_past_a_failed_event_only_once_it_is_recorded() {
    let db = TestDb::producer_wal("wal_confirm").await;
    let broker = TestBroker::new("wal_confirm", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ob = db.outbox(Capture::Wal).await;
    let app = format!("r-{}", db.schema);
    let relay = TestRelay::new(&db, &broker)
        .wal()
        .own_pool(&app, 6)
        .start_logged()
        .await;
    let write = |exchange: Option<String>| {
        let ob = ob.clone();
        let pool = db.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let mut e = NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap();
            if let Some(x) = exchange {
                e = e.exchange(x);
            }
            let id = ob.enqueue(&mut *tx, e).await.unwrap();
            tx.commit().await.unwrap();
            id
        }
    };
    let good = write(None).await;
    wait_until(DEADLINE, "the first event", || async {
        collector.has(&good.to_string())
    })
    .await;
    let before = position(&db).await;
    wait_until(DEADLINE, "the slot confirmed up to it", || async {
        confirmed_past(&db, &before).await
    })
    .await;
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE \"{}\".outbox IN ACCESS EXCLUSIVE MODE",
        db.schema
    )))
    .execute(&mut *lock)
    .await
    .unwrap();
    let bad = write(Some(format!("{}.missing", broker.exchange))).await;
    let after = position(&db).await;
    // The reader waits on the lock to record the failed event...
    wait_until(DEADLINE, "the reader blocked recording it", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE application_name = $1 AND wait_event_type = 'Lock'
                              AND query LIKE 'INSERT INTO%')",
        )
        .bind(&app)
        .fetch_one(&db.pool)
        .await
        .unwrap()
    })
    .await;
    let blocked_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // ...and keeps reporting its position: two reports later the slot
    // has still not moved past the event.
    reports(
        &db,
        &format!("outbox-relay {}", RelayConfig::default().name),
        2,
    )
    .await;
    assert!(
        !confirmed_past(&db, &after).await,
        "the slot moved past an event neither delivered nor recorded (blocked since {blocked_at})"
    );
    lock.commit().await.unwrap();
    wait_until(
        DEADLINE,
        "the event recorded and the slot past it",
        || async {
            db.count("outbox").await + db.count("outbox_dead_letters").await == 1
                && confirmed_past(&db, &after).await
        },
    )
    .await;
    relay.stop().await;
    assert!(!collector.has(&bad.to_string()));
    collector.stop();
    broker.cleanup().await;
}

/// The reader keeps reading while a batch's confirms are out (the next
/// batches go on the wire meanwhile), but the slot never moves past a
/// batch still on the wire: with the broker's answers held back (a slow
/// network), a transaction committed after the event is read, and
/// reported, while the slot stays before the event; once the confirm
/// arrives, the slot moves past both.
#[tokio::test]
async fn wal_slot_stays_before_a_batch_on_the_wire_while_later_ones_are_read() {
    let db = TestDb::producer_wal("wal_window").await;
    let broker = TestBroker::new("wal_window", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let proxy = e2e::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let ob = db.outbox(Capture::Wal).await;
    let name = format!("window-{}", db.schema);
    let application_name = format!("outbox-relay {name}");
    let config = TestRelay::new(&db, &broker).wal().with(|c| {
        c.amqp_url = proxy.url(&amqp_url()).into();
        c.name = name;
    });
    let relay = config
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    let write = || {
        let ob = ob.clone();
        let pool = db.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let e = NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap();
            let id = ob.enqueue(&mut *tx, e).await.unwrap();
            tx.commit().await.unwrap();
            id
        }
    };
    let first = write().await;
    wait_until(DEADLINE, "the first event", || async {
        collector.has(&first.to_string())
    })
    .await;
    let start = position(&db).await;
    wait_until(DEADLINE, "the slot confirmed up to it", || async {
        confirmed_past(&db, &start).await
    })
    .await;
    // The broker's answers (confirms included) now take 6 s to come back:
    // time for the checks below, with room for a busy machine.
    proxy.set(e2e::Mode::Delay(Duration::from_secs(6)));
    let held = write().await;
    let after_held = position(&db).await;
    // A later transaction the reader reads while the event's batch is on
    // the wire: a message of another prefix, no event.
    sqlx::query("SELECT pg_logical_emit_message(true, 'not-outbox', 'x')")
        .execute(&db.pool)
        .await
        .unwrap();
    let after_later = position(&db).await;
    // Two reports from the reader later, the slot is still before the
    // event.
    reports(&db, &application_name, 2).await;
    assert!(
        !confirmed_past(&db, &after_held).await,
        "the slot moved past an event whose confirm had not arrived"
    );
    proxy.set(e2e::Mode::Pass);
    wait_until(
        DEADLINE,
        "the event delivered and the slot past both",
        || async { collector.has(&held.to_string()) && confirmed_past(&db, &after_later).await },
    )
    .await;
    relay.stop().await;
    assert_eq!(db.count("outbox").await, 0, "nothing went to the table");
    collector.stop();
    proxy.stop();
    broker.cleanup().await;
}

/// An ordered aggregate is never in two batches on the wire: its event
/// read while an earlier one's batch awaits its confirms waits for that
/// batch, so when the earlier event comes back unroutable (known only
/// with the confirm), the later one queues behind it in the table instead
/// of overtaking it.
#[tokio::test]
async fn wal_ordered_event_waits_for_its_aggregates_batch_on_the_wire() {
    let db = TestDb::producer_wal("wal_window_ord").await;
    let broker = TestBroker::new("wal_window_ord", FieldTable::default()).await;
    outbox::set_ordered(&db.pool, &db.schema, "acct", true)
        .await
        .unwrap();
    // An exchange with no queue bound: what goes there comes back
    // (mandatory), which only the confirm tells.
    let side = format!("{}.unbound", broker.exchange);
    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        side.as_str().into(),
        lapin::ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let collector = Collector::start(&broker.queue);
    let proxy = e2e::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let ob = db.outbox(Capture::Wal).await;
    let config = TestRelay::new(&db, &broker)
        .wal()
        .with(|c| c.amqp_url = proxy.url(&amqp_url()).into());
    let relay = config
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    // Commits `events` in one transaction; their ids.
    let commit = |events: Vec<NewEvent>| {
        let (ob, pool) = (ob.clone(), db.pool.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let ids = ob.enqueue_many(&mut *tx, events).await.unwrap();
            tx.commit().await.unwrap();
            ids
        }
    };
    let event = |t: &str, id: &str, exchange: Option<&str>| {
        let e = NewEvent::new(t, id, "Happened", &json!({})).unwrap();
        match exchange {
            Some(x) => e.exchange(x),
            None => e,
        }
    };
    // Warm-up, unordered: the reader connects and learns that the
    // unbound exchange exists (no check is left for later).
    let warm = commit(vec![
        event("probe", "p", Some(&side)),
        event("probe", "p", None),
    ])
    .await;
    wait_until(DEADLINE, "the warm-up", || async {
        collector.has(&warm[1].to_string())
            && db.count("outbox").await + db.count("outbox_dead_letters").await == 1
    })
    .await;
    // The returned probe leaves, so the table holds only what follows.
    for table in ["outbox", "outbox_dead_letters"] {
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM \"{}\".{table} WHERE id = $1",
            db.schema
        )))
        .bind(warm[0])
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // Confirms now take 3 s to come back.
    proxy.set(e2e::Mode::Delay(Duration::from_secs(3)));
    // a-1's event 1 goes to the unbound exchange; an unordered marker in
    // the same transaction shows its batch is on the wire.
    let first = commit(vec![
        event("acct", "a-1", Some(&side)),
        event("probe", "p", None),
    ])
    .await;
    wait_until(DEADLINE, "event 1's batch on the wire", || async {
        collector.has(&first[1].to_string())
    })
    .await;
    // Event 2, read while event 1's confirm is still out.
    let second = commit(vec![event("acct", "a-1", None)]).await[0];
    let after = position(&db).await;
    wait_until(
        DEADLINE,
        "both in the table and the slot past them",
        || async {
            assert!(
                !collector.has(&second.to_string()),
                "event 2 overtook event 1"
            );
            db.count("outbox").await == 2 && confirmed_past(&db, &after).await
        },
    )
    .await;
    proxy.set(e2e::Mode::Pass);
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert!(
        !collector.has(&second.to_string()),
        "event 2 overtook event 1"
    );
    proxy.stop();
    let _ = ch
        .exchange_delete(side.as_str().into(), Default::default())
        .await;
    let _ = conn.close(200, "ok".into()).await;
    broker.cleanup().await;
}

#[tokio::test]
async fn wal_ordered_aggregate_waits_behind_its_failed_event_in_the_table() {
    let db = TestDb::producer_wal("wal_order").await;
    let broker = TestBroker::new("wal_order", FieldTable::default()).await;
    outbox::set_ordered(&db.pool, &db.schema, "acct", true)
        .await
        .unwrap();
    let log = SeqLog::start(&broker.queue);
    let ob = db.outbox(Capture::Wal).await;
    let relay = TestRelay::new(&db, &broker)
        .wal()
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    // Event 2 of a-1 goes to an exchange that does not exist yet; a-2 is
    // never held up.
    let side = format!("{}.side", broker.exchange);
    let write = |aggregate: &'static str, exchange: Option<String>| {
        let ob = ob.clone();
        let pool = db.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let mut e = NewEvent::new("acct", aggregate, "Moved", &json!({})).unwrap();
            if let Some(x) = exchange {
                e = e.exchange(x);
            }
            ob.enqueue(&mut *tx, e).await.unwrap();
            tx.commit().await.unwrap();
        }
    };
    write("a-1", None).await;
    write("a-1", Some(side.clone())).await;
    // Once event 2 is in the table, later events of a-1 arrive in later
    // batches of the log: they must queue behind it there.
    wait_until(DEADLINE, "event 2 in the table", || async {
        db.count("outbox").await == 1
    })
    .await;
    for _ in 0..4 {
        write("a-1", None).await;
        write("a-2", None).await;
    }
    // a-1's failed event and the four behind it wait in the table; a-2's
    // events went straight through.
    wait_until(DEADLINE, "a-1 queued in the table", || async {
        assert_eq!(log.seqs_of("a-1"), vec![1], "an event overtook event 2");
        db.count("outbox").await == 5 && log.seqs_of("a-2").len() == 4
    })
    .await;
    assert_eq!(log.seqs_of("a-1"), vec![1], "nothing overtook event 2");
    // The exchange appears, bound to the queue: the table workers publish
    // event 2, then the rest, in order; later events go straight again.
    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        side.as_str().into(),
        lapin::ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_bind(
        broker.exchange.as_str().into(),
        side.as_str().into(),
        "#".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    wait_until(DEADLINE, "a-1 drained from the table", || async {
        db.count("outbox").await == 0
    })
    .await;
    write("a-1", None).await;
    wait_until(DEADLINE, "a-1's seventh event", || async {
        log.seqs_of("a-1").contains(&7)
    })
    .await;
    relay.stop().await;
    log.drain(DEADLINE).await;
    let (first, _) = log.first_arrivals();
    assert_eq!(first["a-1"], (1..=7).collect::<Vec<_>>());
    assert_eq!(first["a-2"], (1..=4).collect::<Vec<_>>());
    let _ = ch
        .exchange_delete(side.as_str().into(), Default::default())
        .await;
    let _ = conn.close(200, "ok".into()).await;
    broker.cleanup().await;
}

#[tokio::test]
async fn wal_standby_relay_takes_over_the_slot() {
    let db = TestDb::producer_wal("wal_standby").await;
    let broker = TestBroker::new("wal_standby", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let cfg_a = || {
        TestRelay::new(&db, &broker)
            .wal()
            .with(|c| c.name = "relay-a".into())
    };
    let cfg_b = TestRelay::new(&db, &broker)
        .wal()
        .with(|c| c.name = "relay-b".into());
    let a = cfg_a()
        .own_pool(&format!("a-{}", db.schema), 6)
        .start_logged()
        .await;
    wait_until(DEADLINE, "relay A reads the slot", || async {
        db.slot_reader().await.as_deref() == Some("outbox-relay relay-a")
    })
    .await;
    let b = cfg_b
        .own_pool(&format!("b-{}", db.schema), 6)
        .start_logged()
        .await;
    let stop_writing = CancellationToken::new();
    let writer = {
        let db = db.clone();
        let stop = stop_writing.clone();
        tokio::spawn(async move {
            let ob = db.outbox(Capture::Wal).await;
            let mut ids = Vec::new();
            while !stop.is_cancelled() {
                let mut tx = db.pool.begin().await.unwrap();
                let id = ob
                    .enqueue(
                        &mut *tx,
                        NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap(),
                    )
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                ids.push(id);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ids
        })
    };
    wait_until(DEADLINE, "events through relay A", || async {
        collector.distinct() >= 50
    })
    .await;
    assert_eq!(
        db.slot_reader().await.as_deref(),
        Some("outbox-relay relay-a"),
        "B waits while A reads"
    );
    // A stops (cleanly): B takes the slot and the stream goes on.
    let stopped = Instant::now();
    a.stop().await;
    let seen = collector.distinct();
    wait_until(DEADLINE, "relay B reads the slot", || async {
        db.slot_reader().await.as_deref() == Some("outbox-relay relay-b")
    })
    .await;
    wait_until(DEADLINE, "events through relay B", || async {
        collector.distinct() > seen + 20
    })
    .await;
    let clean = stopped.elapsed();
    // B's run is dropped mid-stream (no drain, nothing confirmed at the
    // end): A, back as the standby, takes over. (A SIGKILLed or frozen
    // relay process: the fault suite.)
    let a = cfg_a()
        .own_pool(&format!("a2-{}", db.schema), 6)
        .start_logged()
        .await;
    let killed = Instant::now();
    b.abort().await;
    let seen = collector.distinct();
    wait_until(DEADLINE, "relay A reads the slot again", || async {
        db.slot_reader().await.as_deref() == Some("outbox-relay relay-a")
    })
    .await;
    wait_until(DEADLINE, "events through relay A again", || async {
        collector.distinct() > seen + 20
    })
    .await;
    let abrupt = killed.elapsed();
    stop_writing.cancel();
    let ids = writer.await.unwrap();
    wait_until(DEADLINE, "every event", || async {
        ids.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    a.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(collector.distinct(), ids.len());
    println!(
        "handover: clean stop {clean:?}, abrupt end {abrupt:?} (each until 20 more events arrived); {} events, {} copies",
        ids.len(),
        collector.duplicates()
    );
    broker.cleanup().await;
}

/// A nack settles every batch still on the channel before the channel is
/// replaced: with a queue that refuses what it has no room for
/// (`x-overflow = reject-publish`), batches on the wire are nacked
/// mid-window; they all go to the table and are published from there once
/// the queue has room, and the session never ends for it, so nothing
/// delivered is read and published again.
#[tokio::test]
async fn wal_nack_settles_every_batch_on_the_channel_before_replacing_it() {
    use lapin::types::{AMQPValue, ShortString};
    let db = TestDb::producer_wal("wal_nack").await;
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(50));
    args.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString("reject-publish".into()),
    );
    let broker = TestBroker::new("wal_nack", args).await;
    let ob = db.outbox(Capture::Wal).await;
    let cfg = TestRelay::new(&db, &broker).wal().with(|c| {
        c.batch_size = 20;
        c.max_attempts = 100_000;
    });
    let relay = cfg
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    let ids = commit_events(&db, &ob, 400, 10).await;
    let end = position(&db).await;
    // The queue is full: the rest were nacked into the table, and the slot
    // moved past all of them.
    wait_until(
        DEADLINE,
        "nacked events in the table, the slot past the end",
        || async { db.count("outbox").await > 0 && confirmed_past(&db, &end).await },
    )
    .await;
    let collector = Collector::start(&broker.queue);
    wait_until(DEADLINE, "every event", || async {
        ids.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    wait_until(DEADLINE, "the table empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(collector.distinct(), ids.len());
    assert_eq!(
        collector.duplicates(),
        0,
        "a nack ended the session: delivered events were read and published again"
    );
    broker.cleanup().await;
}

/// After a confirm timeout the session ends with the later batches of the
/// window unsettled: they are read and published again. WAL_CAPTURE.md
/// says what that costs: at most four batches' worth of copies (the
/// window), never a lost event.
#[tokio::test]
async fn wal_confirm_timeout_copies_at_most_the_window() {
    const PER_TX: usize = 5;
    let db = TestDb::producer_wal("wal_timeout").await;
    let broker = TestBroker::new("wal_timeout", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let proxy = e2e::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let ob = db.outbox(Capture::Wal).await;
    let batch = 20;
    let cfg = TestRelay::new(&db, &broker).wal().with(|c| {
        c.amqp_url = proxy.url(&amqp_url()).into();
        c.batch_size = batch;
        c.confirm_timeout = Duration::from_millis(1500);
        // The timed-out events go to the table; retried there only once
        // the broker answers in time again, each is one copy (a retry that
        // times out too would be one more).
        c.retry_base = Duration::from_secs(5);
        c.retry_max = Duration::from_secs(5);
    });
    let relay = cfg
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    let warm = commit_events(&db, &ob, 10, 10).await;
    wait_until(DEADLINE, "the relay publishing", || async {
        warm.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    // The broker's answers now come 4 s late: the first batch's confirms
    // time out while later batches are on the wire.
    proxy.set(e2e::Mode::Delay(Duration::from_secs(4)));
    let mut ids = warm;
    ids.extend(commit_events(&db, &ob, 200, PER_TX).await);
    let end = position(&db).await;
    // One timeout: once the timed-out batch is in the table, the broker
    // answers in time again (a second slow session would time out again,
    // each with its own window of copies).
    wait_until(DEADLINE, "the timed-out batch in the table", || async {
        db.count("outbox").await > 0
    })
    .await;
    proxy.set(e2e::Mode::Pass);
    wait_until(
        DEADLINE,
        "every event, the slot past the end, the table empty",
        || async {
            ids.iter().all(|i| collector.has(&i.to_string()))
                && confirmed_past(&db, &end).await
                && db.count("outbox").await == 0
        },
    )
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    proxy.stop();
    assert_eq!(collector.distinct(), ids.len());
    let copies = collector.duplicates();
    // The window, plus the timed-out batch's events of a transaction it
    // holds only the start of: they go to the table, and the slot stays
    // before their transaction, so they are read again too (fewer than a
    // transaction's events; seen: 82).
    let bound = 4 * batch + (PER_TX - 1);
    println!(
        "{copies} copies after a confirm timeout (window: {} events, bound {bound})",
        4 * batch
    );
    assert!(copies > 0, "the timeout landed on nothing in flight");
    assert!(
        copies <= bound,
        "{copies} copies: more than the window of four batches ({}) and a split transaction's {}",
        4 * batch,
        PER_TX - 1
    );
    broker.cleanup().await;
}
