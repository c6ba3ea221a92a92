//! Idempotency keys at the library level, against a real PostgreSQL.
#![allow(
    clippy::explicit_auto_deref,
    reason = "`&mut *tx` is the documented way to pass a transaction"
)]

use std::time::{Duration, Instant};

use e2e::{TestDb, database_url};
use outbox::Error;
use outbox::idempotency::{
    Claim, Fingerprint, Idempotency, IdempotencyConfig, IdempotencyKey, RECOVERY_POINT_STARTED,
    RecordedResponse, TwoPhaseStart, cleanup_idempotency_keys, downstream_key,
};
use sqlx::PgPool;

async fn idempotency(pool: &PgPool, schema: &str, config: IdempotencyConfig) -> Idempotency {
    let mut config = config;
    config.schema = schema.to_owned();
    Idempotency::new(pool, config).await.expect("idempotency")
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k).unwrap()
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of_request("POST", "/orders", body.as_bytes())
}

/// Polls `check` until it holds, failing after `deadline`.
async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Backends blocked on a lock of this test's `idempotency_keys`.
async fn lock_waiters(pool: &PgPool, schema: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE '%' || $1 || '%'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn claim_record_and_replay_in_one_transaction() {
    let db = TestDb::producer("idem_atomic").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let idem = idempotency(&pool, &schema, IdempotencyConfig::default()).await;
    let k = key("k-1");
    let mut tx = pool.begin().await.unwrap();
    let Claim::Execute(claimed) = idem
        .claim(&mut *tx, "t1 POST /orders", &k, fp("a"))
        .await
        .unwrap()
    else {
        panic!("a new key executes");
    };
    let response = RecordedResponse::new(201, b"{\"id\":1}".to_vec())
        .header("Content-Type", "application/json")
        .header("Location", "/orders/1")
        .header("X-Request-Id", "not replayed");
    idem.record(&mut *tx, claimed, &response).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let Claim::Replay(replayed) = idem
        .claim(&mut *tx, "t1 POST /orders", &k, fp("a"))
        .await
        .unwrap()
    else {
        panic!("a completed key replays");
    };
    assert_eq!(replayed.status, 201);
    assert_eq!(replayed.body, b"{\"id\":1}");
    assert_eq!(
        replayed.headers,
        vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("location".to_owned(), "/orders/1".to_owned())
        ],
        "only the allow-listed headers are recorded"
    );
    // Another request under the same key is refused.
    let err = idem
        .claim(&mut *tx, "t1 POST /orders", &k, fp("b"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::IdempotencyKeyMismatch), "{err:?}");
    tx.rollback().await.unwrap();
    // Scopes are separate namespaces.
    let mut tx = pool.begin().await.unwrap();
    let claim = idem
        .claim(&mut *tx, "t2 POST /orders", &k, fp("b"))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Execute(_)));
    tx.rollback().await.unwrap();
    assert_eq!(db.count("idempotency_keys").await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn a_concurrent_claim_waits_for_the_first_then_replays() {
    let db = TestDb::producer("idem_wait").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let idem = idempotency(&pool, &schema, IdempotencyConfig::default()).await;
    let mut first = pool.begin().await.unwrap();
    let Claim::Execute(claimed) = idem
        .claim(&mut *first, "s", &key("k"), fp("a"))
        .await
        .unwrap()
    else {
        panic!("new key");
    };
    let waiter = {
        let (pool, idem) = (pool.clone(), idem.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let claim = idem.claim(&mut *tx, "s", &key("k"), fp("a")).await;
            tx.rollback().await.unwrap();
            claim
        })
    };
    wait_until(
        "the second claim to block",
        Duration::from_secs(10),
        || async { lock_waiters(&pool, &schema).await >= 1 },
    )
    .await;
    idem.record(
        &mut *first,
        claimed,
        &RecordedResponse::new(200, b"done".to_vec()),
    )
    .await
    .unwrap();
    first.commit().await.unwrap();
    match waiter.await.unwrap().unwrap() {
        Claim::Replay(r) => assert_eq!((r.status, r.body.as_slice()), (200, &b"done"[..])),
        other => panic!("expected a replay, got {other:?}"),
    }
    db.cleanup().await;
}

#[tokio::test]
async fn past_the_wait_bound_or_with_no_wait_a_concurrent_claim_gets_in_use() {
    let db = TestDb::producer("idem_busy").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let mut bounded = IdempotencyConfig::default();
    bounded.wait = Duration::from_millis(200);
    bounded.retry_after = Duration::from_secs(2);
    let idem = idempotency(&pool, &schema, bounded).await;
    let no_wait = idempotency(&pool, &schema, {
        let mut c = IdempotencyConfig::default();
        c.wait = Duration::ZERO;
        c
    })
    .await;
    let mut first = pool.begin().await.unwrap();
    let claim = idem
        .claim(&mut *first, "s", &key("k"), fp("a"))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Execute(_)));

    for (handle, at_least) in [
        (&idem, Duration::from_millis(200)),
        (&no_wait, Duration::ZERO),
    ] {
        let mut tx = pool.begin().await.unwrap();
        let started = Instant::now();
        let err = handle
            .claim(&mut *tx, "s", &key("k"), fp("a"))
            .await
            .unwrap_err();
        let waited = started.elapsed();
        assert!(matches!(err, Error::IdempotencyKeyInUse { .. }), "{err:?}");
        assert!(
            waited >= at_least && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        tx.rollback().await.unwrap();
    }
    let mut tx = pool.begin().await.unwrap();
    match idem.claim(&mut *tx, "s", &key("k"), fp("a")).await {
        Err(Error::IdempotencyKeyInUse { retry_after }) => {
            assert_eq!(retry_after, Duration::from_secs(2))
        }
        other => panic!("{other:?}"),
    }
    tx.rollback().await.unwrap();
    // The claim did not leak its lock_timeout into the rest of the transaction.
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *first)
        .await
        .unwrap();
    assert_eq!(timeout, "0");
    first.rollback().await.unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn a_rolled_back_or_killed_claim_leaves_nothing_behind() {
    let db = TestDb::producer("idem_kill").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let idem = idempotency(&pool, &schema, IdempotencyConfig::default()).await;
    // Rolled back: no row, no lock.
    let mut tx = pool.begin().await.unwrap();
    let claim = idem.claim(&mut *tx, "s", &key("k"), fp("a")).await.unwrap();
    assert!(matches!(claim, Claim::Execute(_)));
    tx.rollback().await.unwrap();
    assert_eq!(db.count("idempotency_keys").await, 0);

    // Killed mid-request while a retry waits: the retry takes over at once.
    let mut doomed = pool.begin().await.unwrap();
    let claim = idem
        .claim(&mut *doomed, "s", &key("k"), fp("a"))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Execute(_)));
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *doomed)
        .await
        .unwrap();
    let retry = {
        let (pool, idem) = (pool.clone(), idem.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let claim = idem.claim(&mut *tx, "s", &key("k"), fp("a")).await.unwrap();
            let Claim::Execute(claimed) = claim else {
                panic!("the retry executes")
            };
            idem.record(
                &mut *tx,
                claimed,
                &RecordedResponse::new(201, b"retry".to_vec()),
            )
            .await
            .unwrap();
            tx.commit().await.unwrap();
        })
    };
    wait_until("the retry to block", Duration::from_secs(10), || async {
        lock_waiters(&pool, &schema).await >= 1
    })
    .await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(killed);
    tokio::time::timeout(Duration::from_secs(10), retry)
        .await
        .unwrap()
        .unwrap();
    drop(doomed);
    let mut tx = pool.begin().await.unwrap();
    match idem.claim(&mut *tx, "s", &key("k"), fp("a")).await.unwrap() {
        Claim::Replay(r) => assert_eq!(r.body, b"retry"),
        other => panic!("{other:?}"),
    }
    tx.rollback().await.unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn an_expired_key_counts_as_absent_and_cleanup_removes_it() {
    let db = TestDb::producer("idem_ttl").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let idem = idempotency(&pool, &schema, IdempotencyConfig::default()).await;
    for k in ["old", "fresh"] {
        let mut tx = pool.begin().await.unwrap();
        let Claim::Execute(c) = idem.claim(&mut *tx, "s", &key(k), fp("a")).await.unwrap() else {
            panic!()
        };
        idem.record(&mut *tx, c, &RecordedResponse::new(201, b"first".to_vec()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let within_a_day: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT bool_and(expires_at BETWEEN now() + interval '23 hours' AND now() + interval '25 hours')
         FROM \"{schema}\".idempotency_keys"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(within_a_day, "the default retention is 24 hours");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = 'old'"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // Expired: even a different request under the key executes anew.
    let mut tx = pool.begin().await.unwrap();
    let claim = idem
        .claim(&mut *tx, "s", &key("old"), fp("other"))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Execute(_)), "{claim:?}");
    tx.rollback().await.unwrap();

    assert_eq!(cleanup_idempotency_keys(&pool, &schema).await.unwrap(), 1);
    assert_eq!(cleanup_idempotency_keys(&pool, &schema).await.unwrap(), 0);
    assert_eq!(db.count("idempotency_keys").await, 1);
    // At volume: never a DELETE of more than 1,000 rows (each statement's
    // rows counted by a trigger).
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".idempotency_keys (scope, key, fingerprint, expires_at)
         SELECT 's', 'k-' || g, decode(repeat('00', 32), 'hex'), now() - interval '1 hour'
         FROM generate_series(1, 2500) g;
         CREATE TABLE \"{schema}\".deletes (n bigint NOT NULL);
         CREATE FUNCTION \"{schema}\".count_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO \"{schema}\".deletes SELECT count(*) FROM gone; RETURN NULL; END $$;
         CREATE TRIGGER count_deletes AFTER DELETE ON \"{schema}\".idempotency_keys
             REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".count_deletes();"
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        cleanup_idempotency_keys(&pool, &schema).await.unwrap(),
        2500
    );
    let largest: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT max(n) FROM \"{schema}\".deletes"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(largest <= 1_000, "a DELETE of {largest} rows");
    assert_eq!(db.count("idempotency_keys").await, 1);
    assert!(matches!(
        cleanup_idempotency_keys(&pool, "Bad-Schema").await,
        Err(Error::InvalidIdentifier { .. })
    ));
    db.cleanup().await;
}

#[tokio::test]
async fn key_retention_under_a_held_horizon_walks_each_expired_entry_once() {
    let db = TestDb::producer("idem_walk").await;
    let (setup, schema) = (db.pool.clone(), db.schema.clone());
    const N: i64 = 10_000;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".idempotency_keys (scope, key, fingerprint, expires_at)
         SELECT 's', 'k-' || g, decode(repeat('00', 32), 'hex'), now() - interval '2 hours' + g * interval '1 ms'
         FROM generate_series(1, {N}) g"
    )))
    .execute(&setup)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ANALYZE \"{schema}\".idempotency_keys"
    )))
    .execute(&setup)
    .await
    .unwrap();
    // A long report: while it runs no entry of a deleted row can be
    // removed or marked dead, so a chunk that starts at the oldest entry
    // walks every earlier chunk's rows again.
    let report = e2e::hold_snapshot(&database_url().parse().unwrap()).await;
    let pool = e2e::pool("single", 1).await;
    let before = e2e::scans(&pool, &schema, "idempotency_keys").await;
    assert_eq!(
        cleanup_idempotency_keys(&pool, &schema).await.unwrap(),
        N as u64
    );
    let after = e2e::scans(&pool, &schema, "idempotency_keys").await;
    drop(report);
    assert_eq!(after.0, before.0, "no sequential scan of the keys");
    let walked = after.1 - before.1;
    // Ten chunks: once each is N entries; from the oldest each time, 5.5 N.
    assert!(
        walked <= 2 * N,
        "retention walked {walked} index entries to delete {N} keys"
    );
    // A record expired by hand with '-infinity' (no time chrono can hold)
    // is deleted like any other.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".idempotency_keys (scope, key, fingerprint, expires_at)
         VALUES ('s', 'by-hand', decode(repeat('00', 32), 'hex'), '-infinity')"
    )))
    .execute(&setup)
    .await
    .unwrap();
    assert_eq!(cleanup_idempotency_keys(&pool, &schema).await.unwrap(), 1);
    db.cleanup().await;
}

#[tokio::test]
async fn two_phase_crash_after_the_external_call_resumes_with_the_same_downstream_key() {
    let db = TestDb::producer("idem_2pc").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    // The fake payment gateway dedups on the downstream key, like Stripe.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".gateway_charges (downstream_key uuid PRIMARY KEY, amount int NOT NULL);
         CREATE TABLE \"{schema}\".gateway_calls (n serial PRIMARY KEY, downstream_key uuid NOT NULL);"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let charge = |downstream: uuid::Uuid| {
        let (pool, schema) = (pool.clone(), schema.clone());
        async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "INSERT INTO \"{schema}\".gateway_calls (downstream_key) VALUES ('{downstream}');
                 INSERT INTO \"{schema}\".gateway_charges VALUES ('{downstream}', 500) ON CONFLICT DO NOTHING;"
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let lease = Duration::from_millis(300);
    let idem = idempotency(&pool, &schema, {
        let mut c = IdempotencyConfig::default();
        c.lease = lease;
        c
    })
    .await;
    let (scope, k) = ("t1 POST /payments", key("pay-1"));

    let TwoPhaseStart::Run(mut crashed) = idem.begin_two_phase(scope, &k, fp("pay")).await.unwrap()
    else {
        panic!("a new key runs");
    };
    assert_eq!(crashed.recovery_point(), RECOVERY_POINT_STARTED);
    assert!(!crashed.is_resumed());
    let downstream = crashed.downstream_key();
    assert_eq!(
        downstream,
        downstream_key(scope, &k),
        "derived deterministically"
    );
    charge(downstream).await;
    // ... and the process dies here: no checkpoint, no completion.

    // While the lease lives, a retry is told to come back later.
    match idem.begin_two_phase(scope, &k, fp("pay")).await {
        Err(Error::IdempotencyKeyInUse { retry_after }) => {
            assert!(retry_after <= Duration::from_secs(1))
        }
        other => panic!("{other:?}"),
    }
    let err = idem
        .begin_two_phase(scope, &k, fp("other"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::IdempotencyKeyMismatch), "{err:?}");

    // Once it expires, a retry takes over and resumes.
    let mut resumed = None;
    let start = Instant::now();
    while resumed.is_none() {
        match idem.begin_two_phase(scope, &k, fp("pay")).await {
            Ok(TwoPhaseStart::Run(run)) => resumed = Some(run),
            Err(Error::IdempotencyKeyInUse { .. }) if start.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => panic!("{other:?}"),
        }
    }
    let mut run = resumed.unwrap();
    assert!(run.is_resumed());
    assert_eq!(run.recovery_point(), RECOVERY_POINT_STARTED);
    assert_eq!(
        run.downstream_key(),
        downstream,
        "the retry reuses the downstream key"
    );
    charge(run.downstream_key()).await;
    let mut tx = pool.begin().await.unwrap();
    idem.checkpoint(&mut *tx, &mut run, "charged")
        .await
        .unwrap();
    assert_eq!(run.recovery_point(), "charged");
    idem.complete(&mut *tx, run, &RecordedResponse::new(201, b"paid".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // The crashed attempt, had it woken up, can neither checkpoint nor
    // complete.
    let mut tx = pool.begin().await.unwrap();
    let err = idem
        .checkpoint(&mut *tx, &mut crashed, "charged-again")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::IdempotencyKeyNotHeld), "{err:?}");
    assert_eq!(crashed.recovery_point(), RECOVERY_POINT_STARTED);
    let err = idem
        .complete(
            &mut *tx,
            crashed,
            &RecordedResponse::new(201, b"stale".to_vec()),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::IdempotencyKeyNotHeld), "{err:?}");
    tx.rollback().await.unwrap();

    match idem.begin_two_phase(scope, &k, fp("pay")).await.unwrap() {
        TwoPhaseStart::Replay(r) => assert_eq!((r.status, r.body.as_slice()), (201, &b"paid"[..])),
        other => panic!("{other:?}"),
    }
    let (calls, charges): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(DISTINCT downstream_key) FROM \"{schema}\".gateway_calls) * 100
                + (SELECT count(*) FROM \"{schema}\".gateway_calls),
                (SELECT count(*) FROM \"{schema}\".gateway_charges)"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(calls, 102, "two calls, one downstream key");
    assert_eq!(charges, 1, "charged once");
    db.cleanup().await;
}

#[tokio::test]
async fn two_phase_release_lets_a_retry_resume_at_once() {
    let db = TestDb::producer("idem_release").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let idem = idempotency(&pool, &schema, IdempotencyConfig::default()).await;
    let k = key("k");
    let TwoPhaseStart::Run(mut run) = idem.begin_two_phase("s", &k, fp("a")).await.unwrap() else {
        panic!()
    };
    let mut tx = pool.begin().await.unwrap();
    idem.checkpoint(&mut *tx, &mut run, "reserved")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    idem.release(run).await.unwrap();
    let TwoPhaseStart::Run(run) = idem.begin_two_phase("s", &k, fp("a")).await.unwrap() else {
        panic!()
    };
    assert!(run.is_resumed());
    assert_eq!(run.recovery_point(), "reserved");
    // An atomic claim of a two-phase key in progress is refused, not run.
    let mut tx = pool.begin().await.unwrap();
    let err = idem.claim(&mut *tx, "s", &k, fp("a")).await.unwrap_err();
    assert!(matches!(err, Error::IdempotencyKeyInUse { .. }), "{err:?}");
    tx.rollback().await.unwrap();
    idem.release(run).await.unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn the_table_refuses_what_the_library_refuses() {
    let db = TestDb::producer("idem_table").await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    for bad in [
        "('s', 'has space', decode(repeat('00', 32), 'hex'))",
        "('s', '', decode(repeat('00', 32), 'hex'))",
        "('', 'k', decode(repeat('00', 32), 'hex'))",
        "('s', 'k', '\\x00')",
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".idempotency_keys (scope, key, fingerprint) VALUES {bad}"
        )))
        .execute(&pool)
        .await
        .unwrap_err();
        assert!(err.to_string().contains("check constraint"), "{bad}: {err}");
    }
    let err = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".idempotency_keys (scope, key, fingerprint, state)
         VALUES ('s', 'k', decode(repeat('00', 32), 'hex'), 'completed')"
    )))
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("check constraint"),
        "a completed row needs a response: {err}"
    );
    db.cleanup().await;
}
