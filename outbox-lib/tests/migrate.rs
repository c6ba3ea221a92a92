//! Migrations under a pool's own statement timeout: a run waits for
//! another's locks (and builds its indexes) as long as it must.

use std::time::Duration;

use e2e::{TestDb, database_url, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The per-schema migration lock's first key (outbox-core's
/// `SCHEMA_LOCK_KEY`).
const SCHEMA_LOCK: i32 = 0x6f75_746d;

/// A run of `migrate` on a pool whose sessions time statements out after
/// 200 ms waits for the schema's lock, held for longer by another session,
/// and then migrates: the relay's CLI sets a 30 s timeout, and an index
/// built on a large outbox (migration 17's) takes minutes.
#[tokio::test]
async fn a_run_outlasts_the_pools_statement_timeout() {
    let db = TestDb::empty("mig_timeout").await;
    let options: PgConnectOptions = database_url().parse().unwrap();
    let strict = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            options
                .options([("statement_timeout", "200ms")])
                .application_name("mig-timeout"),
        )
        .await
        .unwrap();
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, hashtext($2))")
        .bind(SCHEMA_LOCK)
        .bind(&db.schema)
        .execute(&mut *holder)
        .await
        .unwrap();
    let run = tokio::spawn({
        let (pool, schema) = (strict.clone(), db.schema.clone());
        async move { outbox::migrate(&pool, &schema).await }
    });
    // The run waits for the lock well past its pool's timeout.
    wait_until(
        Duration::from_secs(30),
        "the run waiting for the schema's lock for over a second",
        || async {
            let waited: bool = sqlx::query_scalar(
                "SELECT coalesce(bool_or(now() - a.query_start > interval '1 second'), false)
                 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = 'mig-timeout'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waited || run.is_finished()
        },
    )
    .await;
    assert!(
        !run.is_finished(),
        "the run ended while the lock was held: {:?}",
        run.await
    );
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext($2))")
        .bind(SCHEMA_LOCK)
        .bind(&db.schema)
        .execute(&mut *holder)
        .await
        .unwrap();
    let applied = run.await.unwrap().expect("migrated once the lock was free");
    assert_eq!(applied.len(), 17, "{applied:?}");
    drop(holder);
    strict.close().await;
    db.cleanup().await;
}
