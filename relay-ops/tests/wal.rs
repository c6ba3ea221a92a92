//! The write-ahead-log capture against the real services: producers write
//! logical decoding messages (`outbox::Capture::Wal`), a relay reads the
//! schema's slot. Set-up, the contract on the wire, what leaves the stream
//! for the tables, the command line, producers refused without a slot, a
//! second database. The slot's position: `wal_slot.rs`; any message on the
//! prefix: `wal_any_message.rs`. Each test has its own schema, slot,
//! exchange and queue.

use std::time::Duration;

use e2e::wal::{emit, emit_sql, with_database};
use e2e::{Collector, TestBroker, TestDb, TestRelay, amqp_url, database_url, wait_until};
use lapin::types::FieldTable;
use outbox::{Capture, NewEvent};
use outbox_relay::WalCapture;
use outbox_relay_ops::admin;
use serde_json::json;
use sqlx::AssertSqlSafe;

const DEADLINE: Duration = Duration::from_secs(60);

async fn slot(db: &TestDb) -> admin::WalSlot {
    admin::wal_slot(&db.pool, &db.ident())
        .await
        .unwrap()
        .expect("the slot exists")
}

#[tokio::test]
async fn wal_set_up_is_checked_created_and_dropped() {
    let db = TestDb::producer("wal_setup").await;
    let s = db.ident();
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
    let err = TestRelay::new(&db, &broker)
        .wal()
        .try_build()
        .await
        .unwrap_err();
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
    let relay = TestRelay::new(&db, &broker)
        .wal()
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;

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
    let relay = TestRelay::new(&db, &broker)
        .wal()
        .own_pool(&format!("r2-{}", db.schema), 6)
        .start_logged()
        .await;
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
    let cfg = TestRelay::new(&db, &broker)
        .wal()
        .with(|c| c.max_attempts = 3);
    let relay = cfg
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
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
    let s = db.ident();
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
    let status = admin::status(&db.pool, &db.ident()).await.unwrap();
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
    outbox_relay::create_wal_slot(&db.pool, &db.ident(), None)
        .await
        .unwrap();
    let mut committed = Vec::new();
    for (id, sql_path) in [("o-1", true), ("o-2", false)] {
        committed.push(order_with_event(id, sql_path).await.unwrap());
    }
    let relay = TestRelay::new(&db, &broker)
        .wal()
        .own_pool(&format!("r-{}", db.schema), 6)
        .start_logged()
        .await;
    wait_until(DEADLINE, "the committed events", || async {
        committed.iter().all(|i| collector.has(&i.to_string()))
    })
    .await;
    relay.stop().await;
    collector.drain(DEADLINE).await;
    assert_eq!(collector.distinct(), committed.len());
    broker.cleanup().await;
}

/// Replication slots are cluster-wide: a second database with a schema of
/// the same name cannot take the first one's `outbox_<schema>`. It is
/// refused in one line that says what to do (`--slot`), and with its own
/// name the second database's capture works beside the first one's.
#[tokio::test]
async fn wal_second_database_with_the_same_schema_names_its_own_slot() {
    let first = TestDb::producer_wal("wal_twodb").await;
    let s = first.ident();
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
    let relay_other = TestRelay::new(&first, &broker)
        .wal()
        .with(|c| c.wal = Some(WalCapture::new(other_url.clone())))
        .pool(pool.clone())
        .start()
        .await;
    let relay_first = TestRelay::new(&first, &broker)
        .wal()
        .own_pool(&format!("r-{}", first.schema), 6)
        .start_logged()
        .await;
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
