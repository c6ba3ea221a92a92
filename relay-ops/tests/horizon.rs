//! The table capture while something holds the xmin horizon back: no
//! vacuum may remove the index entries of published events, and a claim
//! that walked them all again would slow down with every event published
//! (docs/OPERATIONS.md, "A held xmin horizon"). Measured in index entries
//! read (`pg_stat_user_indexes.idx_tup_read` of the claim's index), never
//! in wall time.

use std::collections::HashSet;
use std::time::Duration;

use e2e::{Collector, TestBroker, TestDb, TestRelay, wait_until};
use lapin::types::FieldTable;
use outbox_relay::Relay;

const DEADLINE: Duration = Duration::from_secs(60);

/// Index entries the outbox's index `index` (all of them: `None`) has
/// handed out since the schema began.
async fn entries_read(db: &TestDb, index: Option<&str>) -> i64 {
    let mut conn = db.pool.acquire().await.expect("a connection");
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .expect("fresh statistics");
    sqlx::query_scalar(
        "SELECT sum(idx_tup_read)::int8 FROM pg_stat_user_indexes
         WHERE schemaname = $1 AND relname = 'outbox' AND ($2::text IS NULL OR indexrelname = $2)",
    )
    .bind(&db.schema)
    .bind(index)
    .fetch_one(&mut *conn)
    .await
    .expect("the index's statistics")
}

/// Index entries read once the relay is stopped and its sessions have
/// written their statistics: its idle sessions are ended (an idle session
/// may keep them for ten seconds; one that ends writes them), then two
/// readings a second and a half apart agree.
async fn entries_read_settled(db: &TestDb, index: Option<&str>) -> i64 {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE application_name = 'horizon-' || $1 AND state = 'idle'",
    )
    .bind(&db.schema)
    .execute(&db.pool)
    .await
    .expect("the relay's idle sessions ended");
    let mut last = entries_read(db, index).await;
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = entries_read(db, index).await;
        if now == last {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the index's statistics kept changing"
        );
        last = now;
    }
}

/// A snapshot held from now on, and a relay on a pool of its own (whose
/// idle sessions [`entries_read_settled`] ends) that claims from its
/// cursors alone: no sweep from the index's beginning but a lease
/// change's.
async fn held_horizon_relay(db: &TestDb, broker: &TestBroker) -> (sqlx::PgConnection, Relay) {
    let held = e2e::hold_snapshot(&db.pool.connect_options()).await;
    let relay = TestRelay::new(db, broker)
        .own_pool(&format!("horizon-{}", db.schema), 4)
        .build()
        .await;
    relay.set_claim_sweep(Duration::from_secs(3600));
    (held, relay)
}

/// One round: the backlog in the outbox drained by `relay` (started,
/// then stopped, as an operator would, so the figures settle); returns
/// the index entries (of `index`; all: `None`) read per event of `n`.
async fn drain_round(
    db: &TestDb,
    relay: &Relay,
    index: Option<&str>,
    round: usize,
    n: usize,
) -> f64 {
    let before = entries_read_settled(db, index).await;
    let running = TestRelay::spawn(relay);
    wait_until(DEADLINE, "the backlog to drain", || async {
        db.count("outbox").await == 0
    })
    .await;
    running.stop().await;
    let read = entries_read_settled(db, index).await - before;
    let per_event = read as f64 / n as f64;
    println!(
        "round {}: {read} index entries read for {n} events ({per_event:.2} per event)",
        round + 1
    );
    per_event
}

/// Round `round`'s ordered events: `aggregates` aggregates
/// (`r<round>-a-<i>`) of `depth` events each, interleaved, in one
/// transaction.
async fn insert_rounds_aggregates(db: &TestDb, round: i64, aggregates: i64, depth: i64) {
    let s = &db.schema;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         SELECT 'account', 'r{round}-a-' || (i % {aggregates}), 'Changed', jsonb_build_object('i', i),
                i / {aggregates} + 1
         FROM generate_series(0, {aggregates} * {depth} - 1) i"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Every round read at most `bound` index entries per event.
fn at_most_per_event(per_event: &[f64], bound: f64, otherwise: &str) {
    for (round, read) in per_event.iter().enumerate() {
        assert!(
            *read <= bound,
            "round {} read {read:.2} index entries per event: {otherwise}",
            round + 1
        );
    }
}

/// Rounds of a backlog inserted, then drained by the relay (stopped
/// between rounds, as an operator would stop it, so the figures settle),
/// with a snapshot held from the start: the index entries a round's
/// claims read per event stay flat, where claims from the index's
/// beginning read every entry of every event published before (seen
/// failing that way, in rounds of 20,000: 18.6 per event in the first
/// round, 145 in the fourth; 0.85 to 1.38 with the cursor).
#[tokio::test]
async fn a_held_horizon_does_not_make_claims_walk_the_drained_index_again() {
    const ROUNDS: usize = 3;
    const N: usize = 10_000;
    let db = TestDb::producer("horizon_claim").await;
    let broker = TestBroker::new("horizon", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let (mut held, relay) = held_horizon_relay(&db, &broker).await;
    let mut per_event = Vec::new();
    let mut ids = Vec::new();
    for round in 0..ROUNDS {
        ids.extend(db.produce(N, 500, Duration::ZERO).await);
        per_event.push(drain_round(&db, &relay, Some("outbox_due_idx"), round, N).await);
    }
    let dead: i64 = sqlx::query_scalar(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'outbox'",
    )
    .bind(&db.schema)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    println!("dead outbox rows the held snapshot keeps: {dead}");
    // A claim reads the rows it takes and, at most, those another
    // worker holds: about one entry per event, in every round.
    at_most_per_event(&per_event, 3.0, "claims walk the drained index again");
    sqlx::raw_sql("ROLLBACK").execute(&mut held).await.unwrap();
    collector.drain(Duration::from_secs(60)).await;
    {
        let got = collector.received.lock().unwrap();
        let seen: HashSet<&String> = got.counts.keys().collect();
        assert_eq!(seen, ids.iter().collect(), "every event delivered");
    }
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

/// The ordered claim under a held horizon, as the unordered one above:
/// rounds of ordered events (500 aggregates of ten events each a round)
/// drained with a snapshot held from the start. The index entries read per event stay flat, and every
/// aggregate's events go out in sequence. Seen failing with the claim that
/// walked each partition's aggregates in key order from their first
/// entries: 9.4, 16.8 and 69.2 entries per event.
#[tokio::test]
async fn a_held_horizon_does_not_make_ordered_claims_walk_published_events_again() {
    const ROUNDS: i64 = 3;
    const AGGREGATES: i64 = 500;
    const DEPTH: i64 = 10;
    let n = (AGGREGATES * DEPTH) as usize;
    let db = TestDb::producer("horizon_ordered").await;
    let broker = TestBroker::new("horizon_ordered", FieldTable::default()).await;
    let log = e2e::SeqLog::start(&broker.queue);
    let (mut held, relay) = held_horizon_relay(&db, &broker).await;
    let mut per_event = Vec::new();
    for round in 0..ROUNDS {
        // Aggregates of their own each round: a restart of the relay
        // forgets what its workers knew of their aggregates, and one head
        // lookup from each aggregate's first entry is the restart's price,
        // not the horizon's.
        insert_rounds_aggregates(&db, round, AGGREGATES, DEPTH).await;
        per_event.push(drain_round(&db, &relay, None, round as usize, n).await);
    }
    // Each claim reads its heads (one entry each, and those of the chain
    // published since), its chains and what its walk passes: a few entries
    // per event, in every round.
    at_most_per_event(
        &per_event,
        8.0,
        "ordered claims walk published events again",
    );
    sqlx::raw_sql("ROLLBACK").execute(&mut held).await.unwrap();
    log.drain(Duration::from_secs(60)).await;
    let (first, _) = log.first_arrivals();
    let expected: Vec<i64> = (1..=DEPTH).collect();
    assert_eq!(
        first.len(),
        (ROUNDS * AGGREGATES) as usize,
        "every aggregate published"
    );
    for (aggregate, seqs) in first {
        assert_eq!(seqs, expected, "{aggregate} in sequence");
    }
    db.cleanup().await;
    broker.cleanup().await;
}

/// A producer's transaction left open after writing to the outbox (a
/// connection pool that lost a `COMMIT`, a session "idle in transaction"):
/// it holds the xmin horizon back like any snapshot, and it also holds
/// the floor, below which a row may still commit, at its first write. The
/// claims must not start there every time: rounds of unordered and ordered
/// events drained past it read a few index entries per event in every
/// round. Once it commits, its events are published on the cursors alone
/// (no sweep from the index's beginning), its ordered one in sequence.
#[tokio::test]
async fn a_producer_transaction_left_open_does_not_make_claims_walk_published_events_again() {
    use sqlx::Connection as _;
    const ROUNDS: i64 = 3;
    const UNORDERED: i64 = 4_000;
    const AGGREGATES: i64 = 200;
    const DEPTH: i64 = 10;
    let n = (UNORDERED + AGGREGATES * DEPTH) as usize;
    let db = TestDb::producer("horizon_open_writer").await;
    let broker = TestBroker::new("horizon_open_writer", FieldTable::default()).await;
    let log = e2e::SeqLog::start(&broker.queue);
    let s = &db.schema;
    let mut writer = sqlx::PgConnection::connect_with(&db.pool.connect_options())
        .await
        .expect("a connection");
    let writer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut writer)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN;
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'held-writer', 'OrderPlaced', '{{}}');
         INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         VALUES ('account', 'held-a', 'Changed', '{{}}', 1);"
    )))
    .execute(&mut writer)
    .await
    .expect("the open writer");
    // Left open: older than the 2 s a writer may hold the floor back.
    wait_until(DEADLINE, "the open writer to be 3 s old", || async {
        let age: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8
             FROM pg_stat_activity WHERE pid = $1",
        )
        .bind(writer_pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        age > 3.0
    })
    .await;
    let relay = TestRelay::new(&db, &broker)
        .own_pool(&format!("horizon-{}", db.schema), 4)
        .build()
        .await;
    relay.set_claim_sweep(Duration::from_secs(3600));
    let mut per_event = Vec::new();
    for round in 0..ROUNDS {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'r{round}-u-' || i, 'OrderPlaced', '{{}}'
             FROM generate_series(1, {UNORDERED}) i"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        insert_rounds_aggregates(&db, round, AGGREGATES, DEPTH).await;
        per_event.push(drain_round(&db, &relay, None, round as usize, n).await);
    }
    at_most_per_event(
        &per_event,
        8.0,
        "claims start at the open writer's first row every time",
    );
    // The relay at work again (its leases taken, and any sweep they
    // started done) before the writer commits: what finds its events is
    // the catch-up.
    let running = TestRelay::spawn(&relay);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq)
         VALUES ('account', 'marker', 'Changed', '{{}}', 1)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    wait_until(DEADLINE, "the relay publishing again", || async {
        !log.seqs_of("marker").is_empty() && db.count("outbox").await == 0
    })
    .await;
    sqlx::raw_sql("COMMIT").execute(&mut writer).await.unwrap();
    wait_until(
        DEADLINE,
        "the open writer's events to be published",
        || async { !log.seqs_of("held-writer").is_empty() && !log.seqs_of("held-a").is_empty() },
    )
    .await;
    running.stop().await;
    log.drain(Duration::from_secs(60)).await;
    let (first, _) = log.first_arrivals();
    let expected: Vec<i64> = (1..=DEPTH).collect();
    let mut unordered = 0;
    for (aggregate, seqs) in &first {
        if aggregate.contains("-u-") {
            unordered += 1;
        } else if aggregate.starts_with('r') {
            assert_eq!(seqs, &expected, "{aggregate} in sequence");
        }
    }
    assert_eq!(
        unordered,
        ROUNDS * UNORDERED,
        "every unordered event published"
    );
    assert_eq!(
        first.len() as i64,
        ROUNDS * (UNORDERED + AGGREGATES) + 3,
        "every aggregate published"
    );
    db.cleanup().await;
    broker.cleanup().await;
}

/// `n` events, two a transaction every 100 ms, until all are published.
async fn stream_published(db: &TestDb, collector: &Collector, n: usize) {
    let ids = db.produce(n, 2, Duration::from_millis(100)).await;
    wait_until(DEADLINE, "a stream to be published", || async {
        ids.iter().all(|id| collector.has(id))
    })
    .await;
}

/// Rows commit out of key order: a transaction that wrote its event early
/// and commits late, and one that began early and writes (and commits) late,
/// both while the relay publishes a stream past them. Their events go out on the
/// cursor alone (no sweep): the floor waited for the first (it held the
/// outbox's write lock), and the second's event is due from when it was
/// written (migration 15), not from when its transaction began. Seen
/// failing with the floor blind to writers, and with `now()` as the
/// default: each event then waits for the sweep, which never comes here.
#[tokio::test]
async fn events_that_commit_late_are_claimed_on_the_cursor_alone() {
    let db = TestDb::producer("horizon_late").await;
    let broker = TestBroker::new("horizon_late", FieldTable::default()).await;
    let collector = Collector::start(&broker.queue);
    let relay = TestRelay::new(&db, &broker).build().await;
    relay.set_claim_sweep(Duration::from_secs(3600));
    let running = TestRelay::spawn(&relay);
    let s = &db.schema;
    let insert = format!(
        "INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', $1, 'OrderPlaced', '{{}}') RETURNING id::text"
    );
    // The late writer begins first: it is older than anything the early
    // writer holds the floor at.
    let mut late_writer = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1")
        .execute(&mut *late_writer)
        .await
        .unwrap();
    // Published while only the late writer is open (it holds no write
    // lock yet): two seconds, past the floor's margin.
    stream_published(&db, &collector, 40).await;
    let mut early_writer = db.pool.begin().await.unwrap();
    let written_early: String = sqlx::query_scalar(sqlx::AssertSqlSafe(insert.clone()))
        .bind("early-writer")
        .fetch_one(&mut *early_writer)
        .await
        .unwrap();
    // A stream the relay publishes past both, over several floor readings.
    stream_published(&db, &collector, 60).await;
    let written_late: String = sqlx::query_scalar(sqlx::AssertSqlSafe(insert))
        .bind("late-writer")
        .fetch_one(&mut *late_writer)
        .await
        .unwrap();
    // At once, before the relay reads the lock table again.
    late_writer.commit().await.unwrap();
    // Published past again, then the early writer commits.
    stream_published(&db, &collector, 20).await;
    early_writer.commit().await.unwrap();
    wait_until(DEADLINE, "both late events to be published", || async {
        collector.has(&written_early) && collector.has(&written_late)
    })
    .await;
    running.stop().await;
    collector.stop();
    db.cleanup().await;
    broker.cleanup().await;
}

/// `status`, its gauges and the console name what holds the horizon: a
/// session's pid, application name and state, and the dead rows it keeps.
/// In a database of its own: the horizon is the database's, and other
/// tests' sessions would hold it too.
#[tokio::test]
async fn the_session_holding_the_horizon_is_named_with_the_dead_rows_it_keeps() {
    use sqlx::postgres::PgConnectOptions;
    let admin = e2e::pool("horizon-admin", 1).await;
    let name = format!("horizon_{}", e2e::suffix());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    let options: PgConnectOptions = e2e::database_url().parse().unwrap();
    let pool = sqlx::PgPool::connect_with(options.clone().database(&name))
        .await
        .unwrap();
    outbox::migrate(&pool, "public").await.unwrap();
    let mut held = e2e::hold_snapshot(
        &options
            .clone()
            .database(&name)
            .application_name("a forgotten report"),
    )
    .await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut held)
        .await
        .unwrap();
    sqlx::raw_sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'o-' || i, 'OrderPlaced', '{}' FROM generate_series(1, 2000) i;
         DELETE FROM outbox;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let schema = outbox::Ident::new("schema", "public").unwrap();
    // The deleting session reports its statistics within a second or so.
    let deadline = std::time::Instant::now() + DEADLINE;
    let h = loop {
        let h = outbox_relay_ops::admin::horizon(&pool, &schema)
            .await
            .unwrap();
        if h.outbox_dead_rows >= 2000 {
            break h;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the dead rows never reached the statistics: {h:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("{}", h.describe());
    let oldest = h.oldest.clone().expect("a holder");
    assert_eq!(oldest.kind, "session");
    assert_eq!(oldest.pid, Some(pid));
    assert_eq!(oldest.name, "a forgotten report");
    assert_eq!(oldest.state.as_deref(), Some("idle in transaction"));
    // The transactions begun since the snapshot, cluster-wide: at least
    // the write above (alone on the server, exactly that one; 2 was
    // asserted before and failed whenever this test ran alone).
    assert!(oldest.age_xids >= 1, "{oldest:?}");
    assert!(oldest.age_s.is_some_and(|s| s >= 0.0), "{oldest:?}");
    // Let go: nothing holds it any more.
    sqlx::raw_sql("ROLLBACK").execute(&mut held).await.unwrap();
    let after = outbox_relay_ops::admin::horizon(&pool, &schema)
        .await
        .unwrap();
    assert!(
        after.oldest.as_ref().is_none_or(|o| o.pid != Some(pid)),
        "{after:?}"
    );
    drop(held);
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
}
