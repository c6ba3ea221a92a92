//! The matrix: every capability with every other. Each cell is one way a
//! user deploys the toolkit (capture: the table or the log; producers:
//! Rust or SQL; ordering off or on), run with bad inputs mixed into the
//! stream, the relay SIGKILLed on work in flight, duplicate deliveries
//! injected into the consumer, and judged by the fault suites' one oracle
//! (`world/`) once everything is quiet; four cells, pairing each capture,
//! producer and ordering, also run on the three-node cluster
//! (`cluster_matrix_*`) with the relay's node stopped.

use std::time::Duration;

use e2e::cluster::Cluster;
use e2e::{TestDb, freeze_mid_batch, kill_now, stop_child, suffix, wait_until};
use nix::sys::signal::Signal;
use outbox::{Capture, NewEvent, Outbox};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;

mod world;

use world::{Broker, Committed, Options, World, deadline, scale};

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
    let wire_queue = [w.wire_queue.clone()];
    let conn = w.nodes.connect().await;
    for _ in 0..rounds * 8 {
        if landed >= rounds {
            break;
        }
        // The tap still counting what the last relay published would pass
        // for the new one publishing, and the new one be killed before it
        // read anything (CI: 16 relays killed before their first line, no
        // kill landed): first the tap counts everything the broker holds
        // of the wire, ready or unacknowledged.
        wait_until(
            deadline(),
            "the wire tap to count what was published",
            // A passive declare first: the broker's own count boots a VM.
            || async {
                e2e::depth(&conn, &w.wire_queue).await.0 == 0
                    && w.nodes.uncounted(&wire_queue).await == 0
            },
        )
        .await;
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
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        conn.close(200, "ok".into()),
    )
    .await;
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

macro_rules! matrix {
    ($($name:ident $(, $cluster_name:ident)?: $capture:expr, $producer:expr, $ordered:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            matrix_cell($capture, $producer, $ordered, On::Node).await;
        }

        $(
            /// `make test` runs the `cluster_` tests alone, after the rest:
            /// they stop and start the cluster's nodes.
            #[tokio::test]
            async fn $cluster_name() {
                matrix_cell($capture, $producer, $ordered, On::Cluster).await;
            }
        )?
    )*};
}

// Every cell on one node; on the cluster, four cells that pair every
// capture with every ordering and each producer with each of them (the
// producer writes to PostgreSQL only: what the cluster's node stop meets
// is the capture and the ordering). Eight cluster cells took 260 s of a
// CI run; these four cover every pair of the three.
matrix! {
    matrix_table_rust_unordered:
        Capture::Table, Producer::Rust, false;
    matrix_table_rust_ordered, cluster_matrix_table_rust_ordered:
        Capture::Table, Producer::Rust, true;
    matrix_table_sql_unordered, cluster_matrix_table_sql_unordered:
        Capture::Table, Producer::Sql, false;
    matrix_table_sql_ordered:
        Capture::Table, Producer::Sql, true;
    matrix_wal_rust_unordered, cluster_matrix_wal_rust_unordered:
        Capture::Wal, Producer::Rust, false;
    matrix_wal_rust_ordered:
        Capture::Wal, Producer::Rust, true;
    matrix_wal_sql_unordered:
        Capture::Wal, Producer::Sql, false;
    matrix_wal_sql_ordered, cluster_matrix_wal_sql_ordered:
        Capture::Wal, Producer::Sql, true;
}
