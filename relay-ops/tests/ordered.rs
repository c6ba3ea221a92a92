//! Ordered mode of the relay against the real services: per-aggregate
//! sequence on the wire, failures that block only their own aggregate, the
//! operator's skip, and partition leases that move between relays.

use std::time::{Duration, Instant};

use e2e::{SeqLog, TestBroker, TestDb, TestRelay, wait_until};
use lapin::types::FieldTable;
use outbox::{NewEvent, OrderedAggregates, Outbox, OutboxConfig};
use outbox_relay::RelayConfig;
use outbox_relay_ops::admin;
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

/// The ordered tests' relay: [`TestRelay`]'s settings but a 100 ms poll,
/// retries capped at 200 ms, a thousand attempts, 1 s leases and the
/// default reconnect delays.
fn ordered_relay(db: &TestDb, broker: &TestBroker) -> TestRelay {
    TestRelay::new(db, broker).with(|c| {
        let defaults = RelayConfig::default();
        c.poll_interval = Duration::from_millis(100);
        c.retry_base = Duration::from_millis(50);
        c.retry_max = Duration::from_millis(200);
        c.max_attempts = 1000;
        c.lease_ttl = Duration::from_secs(1);
        c.reconnect_min = defaults.reconnect_min;
        c.reconnect_max = defaults.reconnect_max;
    })
}

async fn ordered_outbox(db: &TestDb) -> Outbox {
    outbox::set_ordered(&db.pool, &db.schema, outbox::ALL_TYPES, true)
        .await
        .unwrap();
    Outbox::new(&db.pool, {
        let mut c = OutboxConfig::default();
        c.schema = db.schema.to_string();
        c.ordering = OrderedAggregates::All;
        c
    })
    .await
    .unwrap()
}

fn event(aggregate: &str, n: i64) -> NewEvent {
    NewEvent::new("account", aggregate, "Changed", &json!({ "n": n })).unwrap()
}

#[tokio::test]
async fn a_failing_event_blocks_only_its_aggregate_until_skipped() {
    let db = TestDb::producer("ord_block").await;
    let broker = TestBroker::new("ord_block", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let ob = ordered_outbox(&db).await;
    // a#1 goes to an exchange that does not exist: it fails on every attempt.
    let mut tx = db.pool.begin().await.unwrap();
    let poison = ob
        .enqueue(&mut *tx, event("a", 1).exchange("no.such.exchange"))
        .await
        .unwrap();
    for n in 1..=5 {
        if n > 1 {
            ob.enqueue(&mut *tx, event("a", n)).await.unwrap();
        }
        ob.enqueue(&mut *tx, event("b", n)).await.unwrap();
    }
    ob.commit(tx).await.unwrap();

    // Two attempts would dead-letter an unordered event; an ordered one
    // stays and blocks its aggregate (a dead letter would be a hole).
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.max_attempts = 2)
        .start()
        .await;
    // No sweep from the index's beginning: once skipped, a's tail (due
    // long before, its events walked past while a#1 blocked them) goes on
    // the walk alone, because the skip writes its next head's due time
    // from the clock. (Seen failing without that write: a's tail waited
    // for a sweep.)
    relay.relay().set_claim_sweep(Duration::from_secs(3600));
    wait_until(DEADLINE, "b's five events", || async {
        log.seqs_of("b").len() >= 5
    })
    .await;
    assert_eq!(log.seqs_of("b"), vec![1, 2, 3, 4, 5]);
    // a is blocked at its first event; status says so and why.
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    // Fifteen attempts (retries 50 to 200 ms apart): long enough for the
    // floor, a second and a half behind the clock, to pass a's tail.
    wait_until(
        DEADLINE,
        "a listed as blocked after 15 attempts",
        || async {
            admin::blocked_aggregates(&db.pool, &schema, 10)
                .await
                .unwrap()
                .first()
                .is_some_and(|b| b.attempts >= 15)
        },
    )
    .await;
    let blocked = admin::blocked_aggregates(&db.pool, &schema, 10)
        .await
        .unwrap();
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    let st = admin::status(&db.pool, &schema).await.unwrap();
    assert_eq!(st.blocked_aggregates, 1);
    assert_eq!(st.blocked[0].event_id, poison);
    assert_eq!(blocked[0].aggregate_id, "a");
    assert_eq!(blocked[0].event_id, poison);
    assert_eq!(blocked[0].aggregate_seq, 1);
    assert_eq!(blocked[0].waiting, 4);
    assert!(
        blocked[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("no.such.exchange")
    );
    assert!(
        log.seqs_of("a").is_empty(),
        "nothing of a overtakes its failing first event"
    );
    assert_eq!(
        db.count("outbox_dead_letters").await,
        0,
        "not dead-lettered"
    );

    // The operator skips it: a moves on, in order.
    let moved = admin::skip_events(&db.pool, &schema, &[poison], "bad exchange")
        .await
        .unwrap();
    assert_eq!(moved, 1);
    wait_until(DEADLINE, "a's remaining events", || async {
        log.seqs_of("a").len() >= 4
    })
    .await;
    assert_eq!(log.seqs_of("a"), vec![2, 3, 4, 5]);
    let (error, seq): (String, Option<i64>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT last_error, aggregate_seq FROM \"{}\".outbox_dead_letters WHERE id = $1",
        db.schema
    )))
    .bind(poison)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(error, "skipped by an operator: bad exchange");
    assert_eq!(seq, Some(1), "the dead letter keeps its sequence number");
    assert!(
        admin::blocked_aggregates(&db.pool, &schema, 10)
            .await
            .unwrap()
            .is_empty()
    );
    relay.stop().await;
    db.cleanup().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn many_aggregates_arrive_in_sequence_with_unordered_events_alongside() {
    let db = TestDb::producer("ord_many").await;
    let broker = TestBroker::new("ord_many", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    outbox::set_ordered(&db.pool, &db.schema, "account", true)
        .await
        .unwrap();
    let ob = Outbox::new(&db.pool, {
        let mut c = OutboxConfig::default();
        c.schema = db.schema.to_string();
        c.ordering = OrderedAggregates::types(["account"]);
        c
    })
    .await
    .unwrap();
    let relay = ordered_relay(&db, &broker).start().await;
    // 40 aggregates x 50 events, committed by 4 concurrent writers while
    // the relay runs, plus unordered events that carry no sequence.
    let mut writers = Vec::new();
    for w in 0..4 {
        let (pool, ob) = (db.pool.clone(), ob.clone());
        writers.push(tokio::spawn(async move {
            for round in 0..50 {
                let mut tx = pool.begin().await.unwrap();
                let mut batch = Vec::new();
                for a in (w..40).step_by(4) {
                    batch.push(event(&format!("acc-{a}"), round));
                }
                ob.enqueue_many(&mut *tx, batch).await.unwrap();
                ob.commit(tx).await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let mut tx = db.pool.begin().await.unwrap();
    ob.enqueue(
        &mut *tx,
        NewEvent::new("cart", "c-1", "Changed", &json!({})).unwrap(),
    )
    .await
    .unwrap();
    ob.commit(tx).await.unwrap();
    wait_until(DEADLINE, "2,001 events", || async { log.len() >= 2001 }).await;
    assert_eq!(log.seqs_of("c-1"), vec![0], "unordered: no sequence header");
    for a in 0..40 {
        let got = log.seqs_of(&format!("acc-{a}"));
        assert_eq!(got, (1..=50).collect::<Vec<_>>(), "acc-{a}");
    }
    wait_until(DEADLINE, "the outbox drained", || async {
        db.count("outbox").await == 0
    })
    .await;
    relay.stop().await;
    db.cleanup().await;
    broker.cleanup().await;
}

async fn leases(db: &TestDb) -> Vec<(Option<uuid::Uuid>, i64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT owner, count(*) FROM \"{}\".outbox_leases WHERE expires_at > now() GROUP BY owner ORDER BY 2",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn leases_split_between_relays_and_move_to_the_survivor() {
    let db = TestDb::producer("ord_lease").await;
    let broker = TestBroker::new("ord_lease", FieldTable::default()).await;
    let a = ordered_relay(&db, &broker).build().await;
    let b = ordered_relay(&db, &broker).build().await;
    let c = ordered_relay(&db, &broker).build().await;
    let running_a = TestRelay::spawn(&a);
    let running_b = TestRelay::spawn(&b);
    let running_c = TestRelay::spawn(&c);
    // Fair share: at most ceil(64 / 3) = 22 each, all 64 held.
    wait_until(DEADLINE, "64 partitions split three ways", || async {
        let l = leases(&db).await;
        l.len() == 3
            && l.iter().all(|(o, n)| o.is_some() && (20..=22).contains(n))
            && l.iter().map(|(_, n)| n).sum::<i64>() == 64
    })
    .await;
    // Clean shutdown: a's leases are released at once.
    running_a.stop().await;
    let l = leases(&db).await;
    assert!(
        l.iter().all(|(o, _)| *o != Some(a.id())),
        "a released its leases on shutdown: {l:?}"
    );
    wait_until(DEADLINE, "b and c share 64", || async {
        let l = leases(&db).await;
        l.len() == 2 && l.iter().map(|(_, n)| n).sum::<i64>() == 64
    })
    .await;
    // Abrupt death: c's task is dropped without releasing anything. b
    // takes over once c's leases expire (TTL 1 s).
    let died = Instant::now();
    running_c.abort().await;
    wait_until(DEADLINE, "b holds all 64", || async {
        leases(&db).await == vec![(Some(b.id()), 64)]
    })
    .await;
    let took = died.elapsed();
    println!("lease handover after an abrupt death: {took:?} (TTL 1 s)");
    assert!(
        took < Duration::from_secs(30),
        "handover bounded by the TTL plus a lease round, took {took:?}"
    );
    running_b.stop().await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// A relay's lease round renews its leases and heartbeat even when the
/// rebalance that comes with it cannot hand partitions over yet (its own
/// batches in flight hold the lease rows, here for longer than many
/// rounds, while a second relay joins); the partitions go once free.
#[tokio::test]
async fn leases_are_renewed_while_a_rebalance_waits_for_batches_in_flight() {
    let db = TestDb::producer("ord_renew").await;
    let broker = TestBroker::new("ord_renew", FieldTable::default()).await;
    let ttl = Duration::from_secs(2);
    let a = ordered_relay(&db, &broker)
        .with(|c| c.lease_ttl = ttl)
        .start()
        .await;
    wait_until(DEADLINE, "a holds 64", || async {
        leases(&db).await == vec![(Some(a.id()), 64)]
    })
    .await;
    let s = &db.schema;
    // Batches in flight: every lease row held FOR KEY SHARE.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT partition FROM \"{s}\".outbox_leases FOR KEY SHARE"
    )))
    .execute(&mut *held)
    .await
    .unwrap();
    // A second relay joins (kept alive by the checks below): a's fair
    // share drops to 32.
    let other = uuid::Uuid::new_v4();
    let heartbeat = sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox_relays (id, name) VALUES ($1, 'other')
         ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()"
    )));
    sqlx::query(heartbeat.clone())
        .bind(other)
        .execute(&db.pool)
        .await
        .unwrap();
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let a_id = a.id();
    let expiry = sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(format!(
        "SELECT min(expires_at) FROM \"{s}\".outbox_leases WHERE owner = $1"
    )));
    // Several TTLs later, a's leases still run: renewed each round.
    for round in 1..=3 {
        wait_until(
            DEADLINE,
            &format!("a's leases renewed, {round} TTL(s) on"),
            || async {
                sqlx::query(heartbeat.clone())
                    .bind(other)
                    .execute(&db.pool)
                    .await
                    .unwrap();
                let min: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(expiry.clone())
                    .bind(a_id)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
                min.is_some_and(|m| m > since + ttl * (round + 1))
            },
        )
        .await;
    }
    assert_eq!(
        leases(&db).await,
        vec![(Some(a.id()), 64)],
        "nothing handed over while held"
    );
    held.rollback().await.unwrap();
    wait_until(
        DEADLINE,
        "a gives up half once the rows are free",
        || async {
            sqlx::query(heartbeat.clone())
                .bind(other)
                .execute(&db.pool)
                .await
                .unwrap();
            leases(&db).await.contains(&(Some(a.id()), 32))
        },
    )
    .await;
    a.stop().await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// Heads that are backing off cost a claim nothing: a worker walks only
/// the ordered events that are due, so a due aggregate behind many blocked
/// ones of its partition goes in the first claim. (Before migration 17 a
/// claim looked at 64 aggregates of a partition, due or not, and reached
/// it in the second.)
#[tokio::test]
async fn blocked_aggregates_cost_a_claim_nothing() {
    let db = TestDb::producer("ord_walk").await;
    let broker = TestBroker::new("ord_walk", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let s = &db.schema;
    // 100 blocked aggregates of partition 7 (heads retried, next attempt in
    // an hour), and one due aggregate of the same partition after them.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq,
                                    attempts, available_at)
         SELECT 'account', id, 'Changed', '{{}}', 1, 1, now() + interval '1 hour'
         FROM (SELECT 'b-' || i AS id FROM generate_series(1, 20000) i) c
         WHERE \"{s}\".outbox_partition('account', id) = 7
         LIMIT 100;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', id, 'Changed', '{{}}', 1
         FROM (SELECT 'zz-' || i AS id FROM generate_series(1, 20000) i) c
         WHERE \"{s}\".outbox_partition('account', id) = 7
         LIMIT 1;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.batch_size = 4)
        .build()
        .await;
    let mut session = relay.connect().await.unwrap();
    let first = relay.run_once(&mut session).await.unwrap();
    assert_eq!(
        first.claimed, 1,
        "the due aggregate's event in the first claim"
    );
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 0);
    wait_until(DEADLINE, "the due aggregate's event", || async {
        log.entries().iter().any(|(a, _)| a.starts_with("zz-"))
    })
    .await;
    session.close(Duration::from_secs(5)).await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// A producer's transaction left open after writing to the outbox holds
/// no ordered aggregate behind blocked ones: with one aggregate's head
/// retried an hour from now and 199 of its events due behind it (five
/// walks' worth), a later aggregate still goes out while the transaction
/// stays open. Seen failing with the floor held at the open writer's first
/// row: every walk started there and read the blocked aggregate's events
/// alone.
#[tokio::test]
async fn an_open_writer_does_not_hold_aggregates_behind_a_blocked_one() {
    use sqlx::Connection as _;
    let db = TestDb::producer("ord_open_writer").await;
    let broker = TestBroker::new("ord_open_writer", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let s = &db.schema;
    let mut writer = sqlx::PgConnection::connect_with(&db.pool.connect_options())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('cart', 'held', 'Changed', '{{}}');"
    )))
    .execute(&mut writer)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq,
                                    attempts, available_at)
         VALUES ('account', 'stuck', 'Changed', '{{}}', 1, 1, now() + interval '1 hour');
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', 'stuck', 'Changed', '{{}}', i FROM generate_series(2, 200) i;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    // In the blocked aggregate's partition: the same worker walks both.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', (SELECT id FROM (SELECT 'later-' || n AS id FROM generate_series(1, 20000) n) c
                            WHERE \"{s}\".outbox_partition('account', id)
                                = \"{s}\".outbox_partition('account', 'stuck')
                            LIMIT 1),
                'Changed', '{{}}', i
         FROM generate_series(1, 5) i;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let later: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT DISTINCT aggregate_id FROM \"{s}\".outbox WHERE aggregate_id LIKE 'later-%'"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.batch_size = 10)
        .build()
        .await;
    // No sweep from the index's beginning: the cursors alone.
    relay.set_claim_sweep(Duration::from_secs(3600));
    let running = TestRelay::spawn(&relay);
    wait_until(DEADLINE, "the later aggregate's five events", || async {
        log.seqs_of(&later).len() >= 5
    })
    .await;
    assert_eq!(log.seqs_of(&later), [1, 2, 3, 4, 5]);
    assert!(
        log.seqs_of("stuck").is_empty(),
        "the blocked head held its own"
    );
    sqlx::raw_sql("COMMIT").execute(&mut writer).await.unwrap();
    wait_until(DEADLINE, "the writer's event", || async {
        !log.seqs_of("held").is_empty()
    })
    .await;
    running.stop().await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// A large ordered backlog does not hold unordered events up: every batch
/// keeps a quarter of its room for them.
#[tokio::test]
async fn unordered_events_are_not_held_up_by_an_ordered_backlog() {
    let db = TestDb::producer("ord_room").await;
    let broker = TestBroker::new("ord_room", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let s = &db.schema;
    // 200 ordered events (of 200 aggregates) committed before 1 unordered.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', 'a-' || i, 'Changed', '{{}}', 1 FROM generate_series(1, 200) i;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('cart', 'c-1', 'Changed', '{{}}');"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.batch_size = 8)
        .build()
        .await;
    let mut session = relay.connect().await.unwrap();
    let first = relay.run_once(&mut session).await.unwrap();
    assert!(
        first.claimed > 8,
        "ordered events filled the batch and more"
    );
    wait_until(
        DEADLINE,
        "the unordered event, from the first batch",
        || async { log.seqs_of("c-1") == vec![0] },
    )
    .await;
    session.close(Duration::from_secs(5)).await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// An aggregate whose head is being retried sends its head alone, and
/// the batch's room goes to unordered events: the claim counts what it
/// sends, not the chain it read behind that head (stop 36's single claim
/// counted the chain, so one failing head capped unordered events at a
/// quarter of every batch).
#[tokio::test]
async fn a_retried_head_leaves_the_rest_of_the_batch_to_unordered_events() {
    let db = TestDb::producer("ord_retry_room").await;
    let broker = TestBroker::new("ord_retry_room", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let s = &db.schema;
    // One aggregate of 100 events, its head failed once and due again;
    // 50 unordered events behind it.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', 'a-1', 'Changed', '{{}}', i FROM generate_series(1, 100) i;
         UPDATE \"{s}\".outbox SET attempts = 1, last_error = 'nacked' WHERE aggregate_seq = 1;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'cart', 'c-' || i, 'Changed', '{{}}' FROM generate_series(1, 50) i;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.batch_size = 20)
        .build()
        .await;
    let mut session = relay.connect().await.unwrap();
    let first = relay.run_once(&mut session).await.unwrap();
    assert_eq!(
        first.claimed, 20,
        "the retried head alone and 19 unordered events"
    );
    wait_until(DEADLINE, "the first batch on the wire", || async {
        log.len() >= 20
    })
    .await;
    let entries = log.entries();
    let ordered: Vec<i64> = entries
        .iter()
        .filter(|(a, _)| a == "a-1")
        .map(|(_, seq)| *seq)
        .collect();
    assert_eq!(ordered, vec![1], "the retried head went alone");
    session.close(Duration::from_secs(5)).await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// `unordered` unordered events (`c-<from>`...) and a chain of `ordered`
/// events of aggregate `aggregate`, in one transaction.
async fn write(db: &TestDb, from: i32, unordered: i32, aggregate: &str, ordered: i64) {
    let s = &db.schema;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'cart', 'c-' || i, 'Changed', '{{}}' FROM generate_series({from}, {from} + {unordered} - 1) i;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', '{aggregate}', 'Changed', '{{}}', i FROM generate_series(1, {ordered}) i;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// While no ordered event waits, a worker claims the unordered events
/// alone; the probe that claim carries sends it back to the full claim: in
/// the same batch when nothing else was claimed, in the next one
/// otherwise. Once the full claim's probe finds no ordered event left, the
/// worker goes back to the unordered claim. (Seen failing without the
/// claim again in the same batch: the chain waited for the next claim.)
#[tokio::test]
async fn a_worker_switches_claims_as_ordered_events_come_and_go() {
    let db = TestDb::producer("ord_switch").await;
    let broker = TestBroker::new("ord_switch", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let relay = ordered_relay(&db, &broker)
        .with(|c| c.batch_size = 10)
        .build()
        .await;
    let mut session = relay.connect().await.unwrap();
    assert!(
        session.claims_ordered(),
        "a worker starts on the full claim"
    );
    write(&db, 1, 2, "none", 0).await;
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 2);
    assert!(
        !session.claims_ordered(),
        "no ordered event: unordered claim"
    );
    // Only ordered events: the unordered claim finds nothing but its
    // probe finds them, and the full claim takes them in the same batch.
    write(&db, 0, 0, "a-1", 3).await;
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 3);
    assert!(session.claims_ordered(), "the chain was there when claimed");
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 0);
    assert!(!session.claims_ordered(), "the chain delivered");
    // Both: the unordered events go first, the chain in the next batch.
    write(&db, 3, 2, "a-2", 2).await;
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 2);
    assert!(session.claims_ordered(), "the probe saw the chain");
    assert_eq!(relay.run_once(&mut session).await.unwrap().claimed, 2);
    wait_until(DEADLINE, "9 events on the wire", || async {
        log.len() >= 9
    })
    .await;
    assert_eq!(log.seqs_of("a-1"), vec![1, 2, 3]);
    assert_eq!(log.seqs_of("a-2"), vec![1, 2]);
    for c in 1..=4 {
        assert_eq!(log.seqs_of(&format!("c-{c}")), vec![0], "c-{c}");
    }
    assert_eq!(db.count("outbox").await, 0);
    session.close(Duration::from_secs(5)).await;
    db.cleanup().await;
    broker.cleanup().await;
}

/// Migration 17 (the index the ordered walk reads) applied while ordered
/// events are written and published: its `CREATE INDEX` holds producers'
/// inserts and the relay's claims for a moment, and nothing is lost or
/// reordered. The schema is taken back to version 16 under a running
/// relay (the index dropped, its record removed), then migrated again
/// between two waves of writers.
#[tokio::test]
async fn migration_17_with_ordered_events_in_flight_loses_nothing_and_keeps_their_order() {
    const AGGREGATES: usize = 20;
    const WAVES: usize = 40;
    const PER_TX: usize = 10;
    let db = TestDb::producer("ord_migrate").await;
    let broker = TestBroker::new("ord_migrate", FieldTable::default()).await;
    let log = SeqLog::start(&broker.queue);
    let s = db.schema.clone();
    outbox::set_ordered(&db.pool, &s, outbox::ALL_TYPES, true)
        .await
        .unwrap();
    let relay = ordered_relay(&db, &broker).build().await;
    let running = TestRelay::spawn(&relay);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP INDEX \"{s}\".outbox_ordered_due_idx;
         DELETE FROM \"{s}\".outbox_toolkit_migrations WHERE migration_set = 'producer' AND version = 17;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let writers = tokio::spawn({
        let (pool, s) = (db.pool.clone(), s.clone());
        async move {
            for wave in 0..WAVES {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'account', 'a-' || ((i + {wave}) % {AGGREGATES}), 'Changed', '{{}}'
                     FROM generate_series(1, {PER_TX}) i"
                )))
                .execute(&pool)
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    // Migrated while the first writers write and the relay publishes.
    wait_until(DEADLINE, "some events published", || async {
        log.len() >= 50
    })
    .await;
    let applied = outbox::migrate(&db.pool, &s).await.unwrap();
    assert_eq!(applied, [17], "migration 17 applied again");
    writers.await.unwrap();
    let total = WAVES * PER_TX;
    wait_until(DEADLINE, "every event published", || async {
        db.count("outbox").await == 0
    })
    .await;
    running.stop().await;
    log.drain(Duration::from_secs(30)).await;
    let (first, _) = log.first_arrivals();
    let published: usize = first.values().map(Vec::len).sum();
    assert_eq!(published, total, "every event on the wire");
    for (aggregate, seqs) in first {
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, expected, "{aggregate} in sequence");
    }
    db.cleanup().await;
    broker.cleanup().await;
}
