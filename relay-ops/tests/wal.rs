//! The write-ahead-log capture against the real services: producers write
//! logical decoding messages (`outbox::Capture::Wal`), a relay reads the
//! schema's slot. Each test has its own schema, slot, exchange and queue.

use std::time::{Duration, Instant};

use e2e::{
    Collector, RunningRelay, SeqLog, TestBroker, TestDb, TestRelay, amqp_url, database_url,
    wait_until,
};
use lapin::types::FieldTable;
use outbox::{Capture, NewEvent};
use outbox_relay::{RelayConfig, WalCapture};
use outbox_relay_ops::admin;
use serde_json::json;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(60);

/// These tests' relay: [`TestRelay`]'s settings, reading the log.
fn wal_relay(db: &TestDb, broker: &TestBroker) -> TestRelay {
    TestRelay::new(db, broker).wal()
}

/// Starts `relay` on a pool of its own (6 connections, sessions named
/// `app`), logging as `RUST_LOG` says.
async fn start(relay: TestRelay, app: &str) -> RunningRelay {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    relay.own_pool(app, 6).start().await
}

fn schema(db: &TestDb) -> outbox::Ident {
    outbox::Ident::new("schema", &db.schema).unwrap()
}

async fn slot(db: &TestDb) -> admin::WalSlot {
    admin::wal_slot(&db.pool, &schema(db))
        .await
        .unwrap()
        .expect("the slot exists")
}

#[tokio::test]
async fn wal_set_up_is_checked_created_and_dropped() {
    let db = TestDb::producer("wal_setup").await;
    let s = schema(&db);
    // No slot: a WAL producer is refused before it writes into nothing,
    // and so is a WAL relay.
    let mut config = outbox::OutboxConfig::default();
    config.schema = db.schema.clone();
    config.capture = Capture::Wal;
    let err = outbox::Outbox::new(&db.pool, config.clone())
        .await
        .unwrap_err();
    assert!(
        matches!(err, outbox::Error::WalCaptureNotReady { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("migrate --capture wal"), "{err}");
    let broker = TestBroker::new("wal_setup", FieldTable::default()).await;
    let err = wal_relay(&db, &broker).try_build().await.unwrap_err();
    assert!(matches!(err, outbox_relay::Error::WalRefused(_)), "{err:?}");
    assert!(admin::wal_slot(&db.pool, &s).await.unwrap().is_none());

    let first = outbox_relay::create_wal_slot(&db.pool, &s, None)
        .await
        .unwrap();
    assert!(first.publication_created && first.slot_created);
    let again = outbox_relay::create_wal_slot(&db.pool, &s, None)
        .await
        .unwrap();
    assert!(!again.publication_created && !again.slot_created);
    outbox::Outbox::new(&db.pool, config.clone()).await.unwrap();
    // A written event the slot holds shows as lag, with no reader.
    let ob = db.outbox(Capture::Wal).await;
    let mut tx = db.pool.begin().await.unwrap();
    ob.enqueue(
        &mut *tx,
        NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let w = slot(&db).await;
    assert!(!w.active && w.reader.is_none());
    assert!(w.lag_bytes.unwrap() > 0, "{w:?}");
    assert_eq!(w.wal_status.as_deref(), Some("reserved"));
    let status = admin::status(&db.pool, &s).await.unwrap();
    assert_eq!(status.wal.unwrap().slot, db.slot());
    assert_eq!(status.backlog, 0, "no row was written");

    assert!(outbox_relay::drop_wal_slot(&db.pool, &s).await.unwrap());
    assert!(!outbox_relay::drop_wal_slot(&db.pool, &s).await.unwrap());
    // A schema that is no producer's (a consumer's, say) has nothing to
    // drop, and says so without an error.
    let other = format!("{}_c", db.schema);
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{other}\"")))
        .execute(&db.pool)
        .await
        .unwrap();
    let other = outbox::Ident::new("schema", &other).unwrap();
    assert!(!outbox_relay::drop_wal_slot(&db.pool, &other).await.unwrap());
    assert!(admin::wal_slot(&db.pool, &other).await.unwrap().is_none());
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{other}\"")))
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(matches!(
        outbox::Outbox::new(&db.pool, config).await.unwrap_err(),
        outbox::Error::WalCaptureNotReady { .. }
    ));
    broker.cleanup().await;
}

#[tokio::test]
async fn wal_publishes_committed_events_with_the_contract_and_never_rolled_back_ones() {
    let db = TestDb::producer_wal("wal_contract").await;
    let broker = TestBroker::new("wal_contract", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ob = db.outbox(Capture::Wal).await;
    let relay = start(wal_relay(&db, &broker), &format!("r-{}", db.schema)).await;

    // Written, then rolled back while the relay reads: never decoded.
    let mut tx = db.pool.begin().await.unwrap();
    let rolled_back = ob
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-0", "OrderPlaced", &json!({"n": 0})).unwrap(),
        )
        .await
        .unwrap();
    // A witness committed while that transaction is open, and one after
    // its rollback: the reader has read past both points.
    let witness = |n: i64| {
        let ob = ob.clone();
        let pool = db.pool.clone();
        async move {
            let mut w = pool.begin().await.unwrap();
            let id = ob
                .enqueue(
                    &mut *w,
                    NewEvent::new("order", "o-w", "OrderPlaced", &json!({"n": -n})).unwrap(),
                )
                .await
                .unwrap();
            ob.commit(w).await.unwrap();
            id
        }
    };
    let w1 = witness(1).await;
    tx.rollback().await.unwrap();
    let w2 = witness(2).await;

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut tx = db.pool.begin().await.unwrap();
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let id = ob
        .enqueue(
            &mut *tx,
            NewEvent::new(
                "order",
                "o-1",
                "OrderPlaced",
                &json!({"sku": "A-1", "qty": 2}),
            )
            .unwrap()
            .header("traceparent", traceparent)
            .header("tenant", "acme"),
        )
        .await
        .unwrap();
    ob.commit(tx).await.unwrap();
    // Other languages: the SQL function, with its defaults.
    let from_sql: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT \"{}\".outbox_emit('invoice', 'i-9', 'InvoiceSent', '{{\"total\": 5}}')",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // Bad input is refused by the function, with nothing emitted.
    let err = sqlx::query(AssertSqlSafe(format!(
        "SELECT \"{}\".outbox_emit('', 'i-9', 'InvoiceSent', '{{}}')",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("must not be empty"), "{err}");
    let err = sqlx::query(AssertSqlSafe(format!(
        "SELECT \"{}\".outbox_emit('invoice', 'i-9', 'InvoiceSent', '{{}}', '[1]')",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("JSON object"), "{err}");

    wait_until(DEADLINE, "the committed events", || async {
        [w1, w2, id, from_sql]
            .iter()
            .all(|i| collector.has(&i.to_string()))
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(db.count("outbox").await, 0, "no row: the log carried them");
    assert_eq!(db.count("outbox_dead_letters").await, 0);
    // Stopped cleanly: the slot was confirmed up to what was published.
    let w = slot(&db).await;
    assert!(!w.active);
    {
        let got = collector.received.lock().unwrap();
        assert!(
            !got.counts.contains_key(&rolled_back.to_string()),
            "a rolled-back event was published"
        );
        assert_eq!(got.counts.len(), 4, "{:?}", got.counts.keys());
        assert_eq!(got.duplicates(), 0, "no fault: no copy");
        let d = &got.first[&id.to_string()];
        e2e::assert_contract(
            d,
            &id.to_string(),
            "OrderPlaced",
            ("order", "o-1"),
            now.timestamp(),
            &[("traceparent", traceparent), ("tenant", "acme")],
            "order.OrderPlaced",
        );
        assert!(
            !d.properties
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .contains_key("x-aggregate-seq"),
            "unordered"
        );
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body, json!({"sku": "A-1", "qty": 2}));
        let d = &got.first[&from_sql.to_string()];
        assert_eq!(d.routing_key.as_str(), "invoice.InvoiceSent");
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body, json!({"total": 5}));
    }
    // A restart publishes nothing again: the clean stop confirmed it all.
    let collector = Collector::start(&broker.queue);
    let relay = start(wal_relay(&db, &broker), &format!("r2-{}", db.schema)).await;
    let w3 = witness(3).await;
    wait_until(DEADLINE, "a witness after the restart", || async {
        collector.has(&w3.to_string())
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(
        collector.distinct(),
        1,
        "a clean restart published again what was confirmed"
    );
    broker.cleanup().await;
}

#[tokio::test]
async fn wal_undeliverable_and_unreadable_messages_leave_the_stream_for_the_tables() {
    let db = TestDb::producer_wal("wal_divert").await;
    let broker = TestBroker::new("wal_divert", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let ob = db.outbox(Capture::Wal).await;
    let cfg = wal_relay(&db, &broker).with(|c| c.max_attempts = 3);
    let relay = start(cfg, &format!("r-{}", db.schema)).await;
    let mut ids = Vec::new();
    let mut bad = None;
    for n in 0..30 {
        let mut tx = db.pool.begin().await.unwrap();
        let mut e =
            NewEvent::new("order", format!("o-{n}"), "OrderPlaced", &json!({"n": n})).unwrap();
        if n == 10 {
            e = e.exchange(format!("{}.missing", broker.exchange));
        }
        let id = ob.enqueue(&mut *tx, e).await.unwrap();
        ob.commit(tx).await.unwrap();
        if n == 10 {
            bad = Some(id);
        } else {
            ids.push(id);
        }
    }
    let bad = bad.unwrap();
    // Messages of our prefix that are no event, and one of another prefix.
    let prefix = format!("outbox:{}", db.schema);
    for (transactional, content) in [(true, "garbage"), (false, "{}")] {
        sqlx::query("SELECT pg_logical_emit_message($1, $2, $3)")
            .bind(transactional)
            .bind(&prefix)
            .bind(content)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query("SELECT pg_logical_emit_message(true, 'someone-else', 'x')")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let last = ob
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-last", "OrderPlaced", &json!({})).unwrap(),
        )
        .await
        .unwrap();
    ob.commit(tx).await.unwrap();
    ids.push(last);

    // The stream went on past the bad event, at once.
    wait_until(DEADLINE, "the good events", || async {
        ids.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    // The bad one was retried in the table, then dead-lettered with its
    // history; the others are dead letters at once.
    wait_until(DEADLINE, "three dead letters", || async {
        db.count("outbox_dead_letters").await == 3 && db.count("outbox").await == 0
    })
    .await;
    relay.stop().await;
    let s = schema(&db);
    let dl = admin::list_dead_letters(&db.pool, &s, 10).await.unwrap();
    let by_id = dl.iter().find(|d| d.id == bad).expect("the bad event");
    assert_eq!(by_id.attempts, 3, "retried by the table workers");
    assert!(
        by_id.last_error.contains("does not exist"),
        "{}",
        by_id.last_error
    );
    let unreadable: Vec<_> = dl
        .iter()
        .filter(|d| d.event_type == "(unreadable)")
        .collect();
    assert_eq!(unreadable.len(), 2, "{dl:?}");
    assert!(
        unreadable
            .iter()
            .any(|d| d.last_error.contains("not an outbox event message"))
            && unreadable
                .iter()
                .any(|d| d.last_error.contains("non-transactional")),
        "{unreadable:?}"
    );
    collector.drain(DEADLINE).await;
    assert!(!collector.has(&bad.to_string()));
    assert_eq!(collector.distinct(), ids.len());
    broker.cleanup().await;
}

/// The log's current end.
async fn position(db: &TestDb) -> String {
    sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Whether the slot's confirmed position has reached `lsn`.
async fn confirmed_past(db: &TestDb, lsn: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(db.slot())
    .bind(lsn)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Waits for `n` more position reports from the replication session
/// named `application_name`.
async fn reports(db: &TestDb, application_name: &str, n: usize) {
    for _ in 0..n {
        let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        wait_until(DEADLINE, "a report from the reader", || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(max(reply_time) > $2, false) FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(application_name)
            .bind(since)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        })
        .await;
    }
}

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
    let relay = start(wal_relay(&db, &broker), &app).await;
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
    let config = wal_relay(&db, &broker).with(|c| {
        c.amqp_url = proxy.url(&amqp_url()).into();
        c.name = name;
    });
    let relay = start(config, &format!("r-{}", db.schema)).await;
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
    let config = wal_relay(&db, &broker).with(|c| c.amqp_url = proxy.url(&amqp_url()).into());
    let relay = start(config, &format!("r-{}", db.schema)).await;
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
    let relay = start(wal_relay(&db, &broker), &format!("r-{}", db.schema)).await;
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
    let cfg_a = || wal_relay(&db, &broker).with(|c| c.name = "relay-a".into());
    let cfg_b = wal_relay(&db, &broker).with(|c| c.name = "relay-b".into());
    let a = start(cfg_a(), &format!("a-{}", db.schema)).await;
    wait_until(DEADLINE, "relay A reads the slot", || async {
        slot(&db).await.reader.as_deref() == Some("outbox-relay relay-a")
    })
    .await;
    let b = start(cfg_b, &format!("b-{}", db.schema)).await;
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
        slot(&db).await.reader.as_deref(),
        Some("outbox-relay relay-a"),
        "B waits while A reads"
    );
    // A stops (cleanly): B takes the slot and the stream goes on.
    let stopped = Instant::now();
    a.stop().await;
    let seen = collector.distinct();
    wait_until(DEADLINE, "relay B reads the slot", || async {
        slot(&db).await.reader.as_deref() == Some("outbox-relay relay-b")
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
    let a = start(cfg_a(), &format!("a2-{}", db.schema)).await;
    let killed = Instant::now();
    b.abort().await;
    let seen = collector.distinct();
    wait_until(DEADLINE, "relay A reads the slot again", || async {
        slot(&db).await.reader.as_deref() == Some("outbox-relay relay-a")
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

/// The command line: `migrate --capture wal` sets the capture up (and says
/// what it did), `status` shows the slot, and `run --capture wal` without
/// a slot exits at once with one line that names the fix.
/// `outbox-relay <args>` on `schema` of the database at `url`: exit code,
/// stdout, stderr.
fn relay_command(url: &str, schema: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .env("DATABASE_URL", url)
        .env("AMQP_URL", amqp_url())
        .env("OUTBOX_SCHEMA", schema)
        .env("RUST_LOG", "warn")
        .args(args)
        .output()
        .expect("outbox-relay");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn wal_command_line_sets_up_shows_and_refuses() {
    let db = TestDb::producer("wal_cli").await;
    let run = |args: &[&str]| relay_command(&database_url(), &db.schema, args);
    let (code, _, err) = run(&["run", "--capture", "wal"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("not set up") && err.contains("migrate --capture wal"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let slot = db.slot();
    let (code, out, err) = run(&["migrate", "--capture", "wal"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains(&format!(
            "publication {slot} created; replication slot {slot} created"
        )),
        "{out}"
    );
    let (_, out, _) = run(&["migrate", "--capture", "wal"]);
    assert!(out.contains("exists; replication slot"), "{out}");
    let (code, out, _) = run(&["status"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&format!("wal slot                {slot} (reserved)")),
        "{out}"
    );
    assert!(out.contains("NONE (no relay reads it"), "{out}");
    let (_, json, _) = run(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["wal"]["slot"], slot.as_str());
}

/// A slot invalidated because the WAL it needed was removed
/// (`max_slot_wal_keep_size`): the relay refuses to start, with one line
/// that says what happened and what it costs. Runs alone: it changes a
/// server setting for a moment.
#[tokio::test]
async fn disruptive_wal_lost_slot_stops_the_relay_with_the_reason() {
    let db = TestDb::producer_wal("wal_lost").await;
    let ob = db.outbox(Capture::Wal).await;
    let mut tx = db.pool.begin().await.unwrap();
    ob.enqueue(
        &mut *tx,
        NewEvent::new("order", "o-1", "OrderPlaced", &json!({})).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let status = || async {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(db.slot())
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(status().await.as_deref(), Some("reserved"));
    let run = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query(sql).execute(&pool).await.unwrap() }
    };
    run("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'").await;
    run("SELECT pg_reload_conf()").await;
    let junk = format!("\"{}\".junk", db.schema);
    let lost = tokio::time::timeout(DEADLINE, async {
        loop {
            // WAL past the limit, then a checkpoint: it removes the old
            // segments and invalidates the slot that still needs them.
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP TABLE IF EXISTS {junk}; CREATE TABLE {junk} AS SELECT g FROM generate_series(1, 200000) g"
            )))
            .execute(&db.pool)
            .await
            .unwrap();
            run("SELECT pg_switch_wal()").await;
            run("CHECKPOINT").await;
            if status().await.as_deref() == Some("lost") {
                break;
            }
        }
    })
    .await;
    run("ALTER SYSTEM RESET max_slot_wal_keep_size").await;
    run("SELECT pg_reload_conf()").await;
    assert!(lost.is_ok(), "the slot was never invalidated");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env("OUTBOX_SCHEMA", &db.schema)
        .env("RUST_LOG", "warn")
        .args(["run", "--capture", "wal"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("was invalidated (wal_status = lost)")
            && err.contains("max_slot_wal_keep_size"),
        "{err}"
    );
    let w = slot(&db).await;
    assert_eq!(w.wal_status.as_deref(), Some("lost"));
    let status = admin::status(&db.pool, &schema(&db)).await.unwrap();
    assert_eq!(status.wal.unwrap().wal_status.as_deref(), Some("lost"));
    // Producers are refused too: nothing would read what they write.
    let err = emit(&db, "o-2").await.unwrap_err();
    assert!(err.to_string().contains("was invalidated"), "{err}");
    let mut tx = db.pool.begin().await.unwrap();
    let err = ob
        .enqueue(
            &mut *tx,
            NewEvent::new("order", "o-3", "OrderPlaced", &json!({})).unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, outbox::Error::WalCaptureNotReady { reason, .. } if reason.contains("invalidated")),
        "{err:?}"
    );
}

/// The SQL producer path: `outbox_emit` of an event of aggregate `$1`
/// (returns its id).
fn emit_sql(
    schema: &str,
) -> sqlx::query::QueryScalar<'static, sqlx::Postgres, uuid::Uuid, sqlx::postgres::PgArguments> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT \"{schema}\".outbox_emit('order', $1, 'OrderPlaced', '{{}}')"
    )))
}

/// One event through the SQL producer path, in its own transaction.
async fn emit(db: &TestDb, aggregate_id: &str) -> Result<uuid::Uuid, sqlx::Error> {
    emit_sql(&db.schema)
        .bind(aggregate_id.to_owned())
        .fetch_one(&db.pool)
        .await
}

/// A producer that writes to the log while no slot would read it is
/// refused, from SQL (`outbox_emit`) and from Rust alike, and its whole
/// transaction with it: the slot dropped under a running producer, the
/// slot forgotten. Nothing a producer committed is lost: once the slot is
/// back, what commits is published.
#[tokio::test]
async fn wal_emit_without_a_readable_slot_is_refused_and_nothing_committed_is_lost() {
    let db = TestDb::producer_wal("wal_noslot").await;
    let broker = TestBroker::new("wal_noslot", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let s = &db.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{s}\".orders (id text PRIMARY KEY)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    // Made while the slot was there: every write checks again.
    let ob = db.outbox(Capture::Wal).await;
    let order_with_event = |id: &'static str, sql_path: bool| {
        let (db, ob) = (&db, &ob);
        async move {
            let mut tx = db.pool.begin().await.unwrap();
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO \"{}\".orders VALUES ($1)",
                db.schema
            )))
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
            let written: Result<uuid::Uuid, String> = if sql_path {
                emit_sql(&db.schema)
                    .bind(id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())
            } else {
                ob.enqueue(
                    &mut *tx,
                    NewEvent::new("order", id, "OrderPlaced", &json!({})).unwrap(),
                )
                .await
                .map_err(|e| format!("{e:?}: {e}"))
            };
            // The caller commits whatever happened: a refused write must
            // have aborted the transaction, order included.
            let _ = tx.commit().await;
            written
        }
    };
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(db.slot())
        .execute(&db.pool)
        .await
        .unwrap();
    for (id, sql_path) in [("o-sql", true), ("o-rust", false)] {
        let err = order_with_event(id, sql_path).await.unwrap_err();
        assert!(
            err.contains(&format!("replication slot {} does not exist", db.slot())),
            "{id}: {err}"
        );
        if !sql_path {
            assert!(err.contains("WalCaptureNotReady"), "{err}");
        }
    }
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DELETE FROM \"{s}\".outbox_wal_capture"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let err = order_with_event("o-unrecorded", true).await.unwrap_err();
    assert!(err.contains("no replication slot is recorded"), "{err}");
    let orders: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{s}\".orders"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(orders, 0, "a refused event took its transaction with it");

    // Set up again: what commits now is read and published.
    outbox_relay::create_wal_slot(&db.pool, &schema(&db), None)
        .await
        .unwrap();
    let mut committed = Vec::new();
    for (id, sql_path) in [("o-1", true), ("o-2", false)] {
        committed.push(order_with_event(id, sql_path).await.unwrap());
    }
    let relay = start(wal_relay(&db, &broker), &format!("r-{}", db.schema)).await;
    wait_until(DEADLINE, "the committed events", || async {
        committed.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(collector.distinct(), committed.len());
    broker.cleanup().await;
}

/// `url` with its database name replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let (server, _) = base
        .rsplit_once('/')
        .expect("a database URL names a database");
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}

/// Replication slots are cluster-wide: a second database with a schema of
/// the same name cannot take the first one's `outbox_<schema>`. It is
/// refused in one line that says what to do (`--slot`), and with its own
/// name the second database's capture works beside the first one's.
#[tokio::test]
async fn wal_second_database_with_the_same_schema_names_its_own_slot() {
    let first = TestDb::producer_wal("wal_twodb").await;
    let s = schema(&first);
    // A failed run's database (its slot goes with it).
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT datname::text FROM pg_database WHERE datname LIKE 't\\_wal\\_twodb\\_%'",
    )
    .fetch_all(&first.pool)
    .await
    .unwrap();
    for d in left {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE \"{d}\" WITH (FORCE)")))
            .execute(&first.pool)
            .await;
    }
    let other = format!("t_wal_twodb_{}", e2e::suffix());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {other}")))
        .execute(&first.pool)
        .await
        .unwrap();
    let other_url = with_database(&database_url(), &other);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&other_url)
        .await
        .unwrap();
    outbox::migrate(&pool, &first.schema).await.unwrap();
    let err = outbox_relay::create_wal_slot(&pool, &s, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, outbox_relay::Error::WalRefused(m) if m.contains("--slot") && m.contains("is taken by a slot of database")),
        "{err:?}"
    );
    let run = |args: &[&str]| relay_command(&other_url, &first.schema, args);
    let (code, _, err) = run(&["migrate", "--capture", "wal"]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert_eq!(err.matches("is taken by").count(), 1, "said once: {err}");
    let own = format!("outbox_two_{}", first.schema);
    let (code, out, err) = run(&["migrate", "--capture", "wal", "--slot", &own]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains(&format!("replication slot {own} created")),
        "{out}"
    );
    // Recorded: the next migrate and the relay find it without the flag.
    let (code, out, err) = run(&["migrate", "--capture", "wal"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains(&format!("replication slot {own} exists")),
        "{out}"
    );
    assert_eq!(
        admin::wal_slot(&pool, &s).await.unwrap().map(|w| w.slot),
        Some(own.clone())
    );

    // Both databases' events reach the broker, each through its own slot.
    let broker = TestBroker::new("wal_twodb", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let relay_other = wal_relay(&first, &broker)
        .with(|c| c.wal = Some(WalCapture::new(other_url.clone())))
        .pool(pool.clone())
        .start()
        .await;
    let relay_first = start(wal_relay(&first, &broker), &format!("r-{}", first.schema)).await;
    let id_first = emit(&first, "o-first").await.unwrap();
    let id_other = emit_sql(&first.schema)
        .bind("o-other")
        .fetch_one(&pool)
        .await
        .unwrap();
    wait_until(DEADLINE, "both databases' events", || async {
        collector.has(&id_first.to_string()) && collector.has(&id_other.to_string())
    })
    .await;
    relay_other.stop().await;
    relay_first.stop().await;
    // A stopped reader's session may outlive it for a moment.
    wait_until(DEADLINE, "the other database's slot dropped", || async {
        outbox_relay::drop_wal_slot(&pool, &s).await.is_ok()
    })
    .await;
    pool.close().await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {other} WITH (FORCE)")))
        .execute(&first.pool)
        .await
        .unwrap();
    broker.cleanup().await;
}

/// One message a test writes on the schema's prefix: an event as any
/// producer might write it (names up to 300 bytes, any JSON, NUL in text,
/// unknown format versions, a missing exchange), JSON that is no event,
/// or text that is no JSON.
#[derive(Debug, Clone)]
enum Written {
    Event {
        id: uuid::Uuid,
        content: String,
        transactional: bool,
    },
    /// JSON that is no event of the contract; `id` when it names one.
    Json {
        id: Option<uuid::Uuid>,
        content: String,
    },
    Text(String),
}

impl Written {
    fn id(&self) -> Option<uuid::Uuid> {
        match self {
            Written::Event { id, .. } => Some(*id),
            Written::Json { id, .. } => *id,
            Written::Text(_) => None,
        }
    }

    fn content(&self) -> &str {
        match self {
            Written::Event { content, .. } | Written::Json { content, .. } => content,
            Written::Text(t) => t,
        }
    }

    fn transactional(&self) -> bool {
        !matches!(
            self,
            Written::Event {
                transactional: false,
                ..
            }
        )
    }
}

mod arbitrary {
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    use super::Written;

    /// Names of 0 to 300 bytes: plain, long, multi-byte, with NUL.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            20 => "[a-zA-Z0-9._-]{1,24}",
            2 => "[a-z]{250,300}",
            1 => "[é]{120,150}",
            1 => "[a-z]{1,4}\u{0}[a-z]{1,4}",
            1 => Just(String::new()),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            ".{0,16}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..4).prop_map(Value::Array),
                btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn event() -> impl Strategy<Value = Written> {
        (
            any::<u128>(),
            prop_oneof![8 => Just(1u32), 1 => Just(2u32), 1 => Just(0u32)],
            (name(), name(), name()),
            json_value(),
            btree_map(name(), json_value(), 0..3),
            prop_oneof![
                6 => Just(None),
                2 => "[a-z]{1,12}".prop_map(|x| Some(format!("missing.{x}"))),
                1 => "[a-z]{256,300}".prop_map(Some),
            ],
            proptest::option::of(name()),
            prop_oneof![9 => Just(true), 1 => Just(false)],
        )
            .prop_map(
                |(
                    id,
                    v,
                    (aggregate_type, aggregate_id, event_type),
                    payload,
                    headers,
                    exchange,
                    routing_key,
                    transactional,
                )| {
                    let id = uuid::Uuid::from_u128(id);
                    let content = json!({
                        "v": v,
                        "id": id,
                        "aggregate_type": aggregate_type,
                        "aggregate_id": aggregate_id,
                        "event_type": event_type,
                        "payload": payload,
                        "headers": Value::Object(headers.into_iter().collect::<Map<_, _>>()),
                        "exchange": exchange,
                        "routing_key": routing_key,
                        "aggregate_seq": null,
                        "created_at": "2026-12-02T04:00:00.123456+00:00",
                    });
                    Written::Event {
                        id,
                        content: content.to_string(),
                        transactional,
                    }
                },
            )
    }

    fn not_an_event() -> impl Strategy<Value = Written> {
        prop_oneof![
            (json_value(), proptest::option::of(any::<u128>())).prop_map(|(v, id)| {
                let id = id.map(uuid::Uuid::from_u128);
                let mut object = match v {
                    Value::Object(m) => m,
                    other => Map::from_iter([("value".to_owned(), other)]),
                };
                object.remove("id");
                if let Some(id) = id {
                    object.insert("id".to_owned(), json!(id));
                }
                Written::Json {
                    id,
                    content: Value::Object(object).to_string(),
                }
            }),
            ".{0,40}"
                .prop_filter("not JSON", |t| serde_json::from_str::<Value>(t).is_err())
                .prop_map(Written::Text),
        ]
    }

    pub(super) fn message() -> impl Strategy<Value = Written> {
        prop_oneof![3 => event(), 1 => not_an_event()]
    }
}

/// Whatever is written on the outbox prefix, by whatever writer, the
/// reader accounts for it (published, queued in the table, or
/// dead-lettered with its reason), the slot moves past it, and the good
/// events around it are published once each: one bad message never holds
/// the stream or makes copies of its neighbours.
#[tokio::test]
async fn wal_any_message_on_the_outbox_prefix_is_accounted_for() {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let db = TestDb::producer_wal("wal_anymsg").await;
    let broker = TestBroker::new("wal_anymsg", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let seed: [u8; 32] = rand_seed();
    println!(
        "seed {}",
        seed.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    );
    let strategy = arbitrary::message();
    let written: Vec<Written> = (0..160)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect();
    let cfg = wal_relay(&db, &broker).with(|c| c.max_attempts = 2);
    let relay = start(cfg, &format!("r-{}", db.schema)).await;
    let prefix = format!("outbox:{}", db.schema);
    let mut neighbours = Vec::new();
    for (n, w) in written.iter().enumerate() {
        // Each bad message between good ones, in one transaction.
        let mut tx = db.pool.begin().await.unwrap();
        let around = |at: String| emit_sql(&db.schema).bind(at);
        neighbours.push(
            around(format!("before-{n}"))
                .fetch_one(&mut *tx)
                .await
                .unwrap(),
        );
        // As bytes: a writer may put anything there, NUL included.
        sqlx::query("SELECT pg_logical_emit_message($1, $2, $3::bytea)")
            .bind(w.transactional())
            .bind(&prefix)
            .bind(w.content().as_bytes())
            .execute(&mut *tx)
            .await
            .unwrap();
        neighbours.push(
            around(format!("after-{n}"))
                .fetch_one(&mut *tx)
                .await
                .unwrap(),
        );
        tx.commit().await.unwrap();
    }
    let end = position(&db).await;

    wait_until(
        DEADLINE,
        "the slot confirmed past every message",
        || async { confirmed_past(&db, &end).await },
    )
    .await;
    wait_until(DEADLINE, "the table's retries settled", || async {
        db.count("outbox").await == 0
    })
    .await;
    wait_until(DEADLINE, "every neighbour", || async {
        neighbours.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;

    let dead: Vec<(uuid::Uuid, String, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregate_type, last_error FROM \"{}\".outbox_dead_letters",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let dead_ids: std::collections::HashSet<uuid::Uuid> = dead.iter().map(|d| d.0).collect();
    let refused_by_table = dead
        .iter()
        .filter(|d| d.2.contains("the outbox table refused"))
        .count();
    let as_text = dead
        .iter()
        .filter(|d| d.2.contains("the dead letters refused its fields too"))
        .count();
    println!(
        "{} messages: {} published, {} dead letters ({} refused by the table, {} kept as text)",
        written.len(),
        collector.distinct() - neighbours.len(),
        dead.len(),
        refused_by_table,
        as_text
    );
    assert!(
        dead.iter().all(|d| !d.2.is_empty()),
        "every dead letter says why"
    );
    let mut unaccounted = Vec::new();
    for w in &written {
        if let Some(id) = w.id() {
            let published = collector.has(&id.to_string());
            let dead = dead_ids.contains(&id);
            if published == dead {
                unaccounted.push(format!(
                    "published {published}, dead-lettered {dead}: {w:?}"
                ));
            }
        }
    }
    assert!(unaccounted.is_empty(), "{unaccounted:#?}");
    let known: std::collections::HashSet<uuid::Uuid> =
        written.iter().filter_map(Written::id).collect();
    let anonymous = written.iter().filter(|w| w.id().is_none()).count();
    let anonymous_dead = dead
        .iter()
        .filter(|d| d.1 == "(unreadable)" && !known.contains(&d.0))
        .count();
    assert_eq!(
        anonymous_dead, anonymous,
        "messages without an id, dead-lettered"
    );
    assert!(
        neighbours.iter().all(|i| !dead_ids.contains(i)),
        "a good event was dead-lettered"
    );
    assert_eq!(collector.duplicates(), 0, "nothing was published twice");
    broker.cleanup().await;
}

/// A fresh seed, or the one `WAL_ANYMSG_SEED` names (64 hex digits, as
/// the test prints it), to replay a failure.
fn rand_seed() -> [u8; 32] {
    let mut seed = [0u8; 32];
    if let Ok(hex) = std::env::var("WAL_ANYMSG_SEED") {
        assert_eq!(hex.len(), 64, "WAL_ANYMSG_SEED: 64 hex digits");
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("WAL_ANYMSG_SEED: hex");
        }
        return seed;
    }
    seed[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    seed[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    seed
}

/// Commits `n` events through `ob`, `per_tx` per transaction; returns
/// their ids.
async fn commit_events(
    db: &TestDb,
    ob: &outbox::Outbox,
    n: usize,
    per_tx: usize,
) -> Vec<uuid::Uuid> {
    let mut ids = Vec::with_capacity(n);
    for start in (0..n).step_by(per_tx) {
        let mut tx = db.pool.begin().await.unwrap();
        for i in start..(start + per_tx).min(n) {
            let e =
                NewEvent::new("order", format!("o-{i}"), "OrderPlaced", &json!({"i": i})).unwrap();
            ids.push(ob.enqueue(&mut *tx, e).await.unwrap());
        }
        tx.commit().await.unwrap();
    }
    ids
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
    let cfg = wal_relay(&db, &broker).with(|c| {
        c.batch_size = 20;
        c.max_attempts = 100_000;
    });
    let relay = start(cfg, &format!("r-{}", db.schema)).await;
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
    let cfg = wal_relay(&db, &broker).with(|c| {
        c.amqp_url = proxy.url(&amqp_url()).into();
        c.batch_size = batch;
        c.confirm_timeout = Duration::from_millis(1500);
        // The timed-out events go to the table; retried there only once
        // the broker answers in time again, each is one copy (a retry that
        // times out too would be one more).
        c.retry_base = Duration::from_secs(5);
        c.retry_max = Duration::from_secs(5);
    });
    let relay = start(cfg, &format!("r-{}", db.schema)).await;
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

/// The tests here leave their clean-up to `TestDb`'s drop: a test that
/// panics still leaves neither its schema nor its slot (a slot left behind
/// would hold WAL for ever).
#[tokio::test]
async fn wal_a_panicking_test_leaves_neither_its_schema_nor_its_slot() {
    let reader = tokio::spawn(async {
        let db = TestDb::producer_wal("wal_panics").await;
        let names = (db.schema.clone(), db.slot());
        std::panic::panic_any(names);
    });
    let panic = reader.await.unwrap_err().into_panic();
    let (schema, slot) = *panic.downcast::<(String, String)>().unwrap();
    let pool = e2e::pool("wal-panics-check", 1).await;
    let schemas: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(&schema)
        .fetch_one(&pool)
        .await
        .unwrap();
    let slots: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&slot)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((schemas, slots), (0, 0), "{schema} and {slot} are gone");
}
