//! Inbox retention at volume: days dropped whole, the rest in chunks of at
//! most 1,000 rows, parked copies holding it back, and the live migration
//! from the inbox of the release before.

use std::time::Duration;

use chrono::{DateTime, Days, Utc};
use e2e::consumer::{Env, Running, id, wait_until};
use outbox_consumer::{
    Consumer, DEFAULT_RETENTION, Event, Handler, Outcome, RetentionTask, cleanup_inbox,
    inbox_retention,
};
use sqlx::{AssertSqlSafe, PgConnection};

async fn exec(env: &Env, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(sql.replace("{s}", &env.schema)))
        .execute(&env.pool)
        .await
        .unwrap();
}

/// The day partition of `days` days ago (UTC), created as the migration
/// creates those ahead; its name.
async fn past_day(env: &Env, days: u64) -> (String, DateTime<Utc>) {
    let day = Utc::now()
        .date_naive()
        .checked_sub_days(Days::new(days))
        .unwrap();
    let name = format!("inbox_p{}", day.format("%Y%m%d"));
    let from = day.and_hms_opt(0, 0, 0).unwrap().and_utc();
    let to = from + chrono::Duration::days(1);
    exec(
        env,
        &format!(
            "CREATE TABLE {{s}}.{name} PARTITION OF {{s}}.inbox_processed FOR VALUES FROM ('{}') TO ('{}')",
            from.to_rfc3339(),
            to.to_rfc3339()
        ),
    )
    .await;
    (name, from)
}

/// A UUIDv7 key in canonical text form carrying `at` (and `n` in its
/// random part): what `Outbox::enqueue` writes, from another day.
fn v7_at(at: DateTime<Utc>, n: u64) -> String {
    let ms = u64::try_from(at.timestamp_millis()).unwrap();
    let h = format!("{ms:012x}");
    format!("{}-{}-7000-8000-{n:012x}", &h[..8], &h[8..])
}

/// `n` records of consumer `who` with keys from `at` onwards.
async fn records_of_day(env: &Env, who: &str, at: DateTime<Utc>, n: u64) {
    let keys: Vec<String> = (0..n)
        .map(|i| v7_at(at + chrono::Duration::seconds(i as i64), i))
        .collect();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {0}.inbox_processed (consumer, event_id, event_at)
         SELECT $1, k, {0}.inbox_event_time(k) FROM unnest($2::text[]) k",
        env.schema
    )))
    .bind(who)
    .bind(&keys)
    .execute(&env.pool)
    .await
    .unwrap();
}

async fn exists(env: &Env, table: &str) -> bool {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT to_regclass('{}.{table}') IS NOT NULL",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_time_a_key_carries_picks_its_partition() {
    let env = Env::new().await;
    let s = &env.schema;
    for _ in 0..20 {
        let u = uuid::Uuid::now_v7();
        let (secs, nanos) = u.get_timestamp().unwrap().to_unix();
        let ms = secs as i64 * 1000 + i64::from(nanos / 1_000_000);
        for key in [u.to_string(), u.to_string().to_uppercase()] {
            let at: DateTime<Utc> =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT {s}.inbox_event_time($1)")))
                    .bind(&key)
                    .fetch_one(&env.pool)
                    .await
                    .unwrap();
            assert_eq!(at.timestamp_millis(), ms, "{key}");
        }
    }
    // Keys that carry no time: another UUID version, the simple form, a
    // natural key. They land in inbox_untimed.
    let v4 = uuid::Uuid::new_v4();
    for key in [
        v4.to_string(),
        uuid::Uuid::now_v7().simple().to_string(),
        "order-42".to_owned(),
    ] {
        let untimed: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {s}.inbox_event_time($1) = '-infinity'"
        )))
        .bind(&key)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert!(untimed, "{key}");
    }
    // Today and the days ahead are prepared by the migration.
    let today = format!("inbox_p{}", Utc::now().format("%Y%m%d"));
    assert!(exists(&env, &today).await, "{today}");
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_days_past_the_window_whole_and_deletes_the_rest_in_small_chunks() {
    let env = Env::new().await;
    let (old_day, old_at) = past_day(&env, 10).await;
    let (kept_day, kept_at) = past_day(&env, 3).await;
    records_of_day(&env, "a", old_at, 5_000).await;
    records_of_day(&env, "b", old_at, 5_000).await;
    records_of_day(&env, "a", kept_at, 300).await;
    // Keys that carry no time, and version 1's table (records from before
    // the migration), each statement that deletes from it counted.
    exec(
        &env,
        "INSERT INTO {s}.inbox_processed (consumer, event_id, event_at, processed_at)
         SELECT c, c || '-old-' || i, '-infinity', now() - interval '8 days' FROM unnest(ARRAY['a','b']) c, generate_series(1, 1500) i;
         INSERT INTO {s}.inbox_processed (consumer, event_id, event_at, processed_at)
         SELECT c, c || '-young-' || i, '-infinity', now() - interval '6 days 23 hours' FROM unnest(ARRAY['a','b']) c, generate_series(1, 10) i;
         ALTER TABLE {s}.inbox DISABLE TRIGGER inbox_v1_claim;
         INSERT INTO {s}.inbox (consumer, event_id, processed_at)
         SELECT 'a', 'v1-' || i, now() - interval '8 days' FROM generate_series(1, 2500) i;
         ALTER TABLE {s}.inbox ENABLE TRIGGER inbox_v1_claim;
         CREATE TABLE {s}.deletes (n bigint NOT NULL);
         CREATE FUNCTION {s}.count_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO {s}.deletes SELECT count(*) FROM gone; RETURN NULL; END $$;
         CREATE TRIGGER count_deletes AFTER DELETE ON {s}.inbox
             REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {s}.count_deletes();",
    )
    .await;
    exec(&env, "ANALYZE {s}.inbox_processed").await;

    let report = inbox_retention(&env.pool, &env.schema, None, DEFAULT_RETENTION)
        .await
        .unwrap();
    assert_eq!(report.days_dropped, vec![old_day.clone()]);
    assert_eq!(report.day_rows_estimate, 10_000);
    assert_eq!(report.rows_deleted, 3_000 + 2_500);
    assert_eq!(report.held, None);
    assert!(!exists(&env, &old_day).await);
    assert_eq!(env.count(&format!("{{s}}.{kept_day}")).await, 300);
    assert_eq!(env.count("{s}.inbox_untimed").await, 20);
    assert_eq!(env.count("{s}.inbox").await, 0);
    let largest: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT max(n) FROM {}.deletes",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(largest <= 1_000, "a DELETE of {largest} rows");

    // One consumer's chunked records with a one-day window; the day of 3
    // days ago goes whole (days hold every consumer's records).
    let removed = cleanup_inbox(
        &env.pool,
        &env.schema,
        Some("a"),
        Duration::from_secs(86_400),
    )
    .await
    .unwrap();
    assert_eq!(removed, 10 + 300);
    assert!(!exists(&env, &kept_day).await);
    assert_eq!(
        env.count("{s}.inbox_untimed WHERE consumer = 'b'").await,
        10
    );
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_retention_under_a_held_horizon_walks_each_record_once() {
    use sqlx::Connection;
    let env = Env::new().await;
    const N: i64 = 10_000;
    exec(
        &env,
        &format!(
            "INSERT INTO {{s}}.inbox_processed (consumer, event_id, event_at, processed_at)
             SELECT 'a', 'order-' || i, '-infinity', now() - interval '9 days' + i * interval '1 ms'
             FROM generate_series(1, {N}) i;
             ANALYZE {{s}}.inbox_processed;"
        ),
    )
    .await;
    // A long report holds the horizon: no entry of a deleted record can be
    // removed or marked dead, so a chunk that starts at the oldest entry
    // walks every earlier chunk's records again.
    let mut report = sqlx::PgConnection::connect(&e2e::consumer::db_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut report)
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&e2e::consumer::db_url())
        .await
        .unwrap();
    let before = e2e::scans(&pool, &env.schema, "inbox_untimed").await;
    let done = inbox_retention(&pool, &env.schema, None, DEFAULT_RETENTION)
        .await
        .unwrap();
    let after = e2e::scans(&pool, &env.schema, "inbox_untimed").await;
    drop(report);
    assert_eq!(done.rows_deleted, N as u64);
    assert_eq!(after.0, before.0, "no sequential scan of the records");
    let walked = after.1 - before.1;
    // Ten chunks: once each is N entries; from the oldest each time, 5.5 N.
    assert!(
        walked <= 2 * N,
        "retention walked {walked} index entries to delete {N} records"
    );
    pool.close().await;
    env.teardown().await;
}

/// Rejects every event: each goes to the dead-letter queue, parked.
struct RejectAll;

impl Handler for RejectAll {
    async fn handle(&self, _: &mut PgConnection, _: &Event) -> Outcome {
        Outcome::reject("not today")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_parked_in_the_dead_letter_queue_holds_its_day_until_the_queue_is_empty() {
    let env = Env::new().await;
    let (day, at) = past_day(&env, 10).await;
    // Applied 10 days ago: the record a late copy must still meet.
    records_of_day(&env, "svc", at, 1).await;
    // Another copy of the same event was dead-lettered back then.
    let applied = v7_at(at, 0);
    let c = Running::start(Consumer::new(env.config("svc"), env.pool.clone(), RejectAll).unwrap());
    env.publish(Some(&id()), "{}").await; // today's, parked too
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {s}.inbox_processed WHERE event_id = $1"
    )))
    .bind(&applied)
    .execute(&env.pool)
    .await
    .unwrap();
    env.publish(Some(&applied), "{}").await;
    wait_until("both copies dead-lettered and parked", || async {
        env.count("{s}.inbox_parked").await == 2 && c.consumer.stats().acked() == 2
    })
    .await;
    c.stop().await;
    // Put the applied record back (its copy was applied by another path).
    records_of_day(&env, "svc", at, 1).await;
    let parked_at: DateTime<Utc> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT event_at FROM {s}.inbox_parked WHERE event_id = $1"
    )))
    .bind(&applied)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(parked_at.timestamp_millis(), at.timestamp_millis());
    // Past the five minutes in which a park may precede its republish.
    exec(
        &env,
        "UPDATE {s}.inbox_parked SET parked_at = parked_at - interval '10 minutes'",
    )
    .await;

    let task = RetentionTask::for_consumer(env.pool.clone(), &env.config("svc"));
    let held = task.run_once().await.unwrap();
    assert!(held.days_dropped.is_empty(), "{held:?}");
    let h = held.held.expect("the parked copy holds retention back");
    assert_eq!(h.parked, 2);
    assert_eq!(
        h.oldest_event_at.map(|t| t.timestamp_millis()),
        Some(at.timestamp_millis())
    );
    assert!(exists(&env, &day).await);

    // The dead-letter queue is emptied (replayed, or purged): the day goes.
    let dlq = env.config("svc").dead_letter_queue();
    let purged = env
        .channel
        .queue_purge(dlq.as_str().into(), Default::default())
        .await
        .unwrap();
    assert_eq!(purged, 2);
    let released = task.run_once().await.unwrap();
    assert_eq!(released.days_dropped, vec![day.clone()], "{released:?}");
    assert_eq!(released.held, None);
    assert_eq!(env.count("{s}.inbox_parked").await, 0);
    env.teardown().await;
}

/// One effect per event, counted.
struct Effect(String);

impl Handler for Effect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let sql = format!("INSERT INTO {}.effects (event_id) VALUES ($1)", self.0);
        match sqlx::query(AssertSqlSafe(sql))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::retry(e),
        }
    }
}

/// The release before wrote its records to version 1's `inbox`. Copies of
/// those events and new ones wait in the queue while the inbox migrates;
/// then none of the old events applies again, every new one once, and a
/// consumer of the release before, still running, is arbitrated with this
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_before_the_migration_keep_deduplicating_while_events_flow() {
    let env = Env::at_version_2().await;
    let s = env.schema.clone();
    let before: Vec<String> = (0..300).map(|_| id()).collect();
    // The previous release's claim, as it ran.
    let v1_claim = format!(
        "INSERT INTO {s}.inbox (consumer, event_id) SELECT $1, k FROM unnest($2::text[]) AS k \
         ON CONFLICT (consumer, event_id) DO NOTHING RETURNING event_id"
    );
    let fresh: Vec<String> = sqlx::query_scalar(AssertSqlSafe(v1_claim.clone()))
        .bind("svc")
        .bind(&before)
        .fetch_all(&env.pool)
        .await
        .unwrap();
    assert_eq!(fresh.len(), 300);
    let after: Vec<String> = (0..300).map(|_| id()).collect();
    let mut messages: Vec<(Option<String>, Vec<u8>)> = Vec::new();
    for (old, new) in before.iter().zip(&after) {
        messages.push((Some(old.clone()), b"{}".to_vec()));
        messages.push((Some(new.clone()), b"{}".to_vec()));
    }
    env.publish_all(&messages).await;

    let migrating = tokio::spawn({
        let pool = env.pool.clone();
        let s = s.clone();
        async move { outbox_consumer::migrate(&pool, &s).await }
    });
    migrating.await.unwrap().unwrap();
    let c = Running::start(
        Consumer::new(env.config("svc"), env.pool.clone(), Effect(s.clone())).unwrap(),
    );
    // Meanwhile a consumer of the release before claims some of the new
    // events and some old ones through version 1's table.
    let racing: Vec<String> = after[..50].iter().chain(&before[..50]).cloned().collect();
    let v1_fresh: Vec<String> = sqlx::query_scalar(AssertSqlSafe(v1_claim))
        .bind("svc")
        .bind(&racing)
        .fetch_all(&env.pool)
        .await
        .unwrap();
    wait_until("every copy settled", || async {
        c.consumer.stats().acked() == 600
    })
    .await;
    c.stop().await;
    let applied_here = env.count("{s}.effects").await;
    // Each new event once: here, or by the consumer of the release before
    // (which applies what its claim returned).
    assert!(
        v1_fresh.iter().all(|k| after.contains(k)),
        "an old event was fresh to the old claim: {v1_fresh:?}"
    );
    assert_eq!(applied_here + v1_fresh.len() as i64, 300);
    let old_applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.effects WHERE event_id = ANY($1)"
    )))
    .bind(&before)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        old_applied, 0,
        "an event applied before the migration applied again"
    );
    // Retention empties version 1's table once its records are past the
    // window, in chunks.
    let report = inbox_retention(&env.pool, &s, None, Duration::ZERO)
        .await
        .unwrap();
    assert!(report.rows_deleted >= 300, "{report:?}");
    assert_eq!(env.count("{s}.inbox").await, 0);
    env.teardown().await;
}
