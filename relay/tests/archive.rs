//! The archive (`--archive`) at volume: published events kept in day
//! partitions, each dropped whole once older than `--archive-retention`;
//! version 1's `outbox_published` (filled by relays of an earlier release)
//! trimmed at most 1,000 rows a statement.

use std::time::Duration;

use chrono::{Days, Utc};
use e2e::{Collector, TestBroker, TestDb, TestRelay, wait_until};
use lapin::types::FieldTable;
use sqlx::AssertSqlSafe;

const DEADLINE: Duration = Duration::from_secs(60);

async fn exec(db: &TestDb, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(
        sql.replace("{s}", &format!("\"{}\"", db.schema)),
    ))
    .execute(&db.pool)
    .await
    .unwrap();
}

async fn exists(db: &TestDb, table: &str) -> bool {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT to_regclass('\"{}\".{table}') IS NOT NULL",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_archive_keeps_days_and_drops_them_whole_past_the_retention() {
    let db = TestDb::producer("archive").await;
    let broker = TestBroker::new("archive", FieldTable::default()).await;
    // A day archived ten days ago, one three days ago, and version 1's
    // table with rows of eight days ago and of yesterday.
    let mut days = Vec::new();
    for ago in [10, 3] {
        let day = Utc::now()
            .date_naive()
            .checked_sub_days(Days::new(ago))
            .unwrap();
        let name = format!("outbox_archive_p{}", day.format("%Y%m%d"));
        let from = day.and_hms_opt(0, 0, 0).unwrap().and_utc();
        exec(
            &db,
            &format!(
                "CREATE TABLE {{s}}.{name} PARTITION OF {{s}}.outbox_archive FOR VALUES FROM ('{}') TO ('{}');
                 INSERT INTO {{s}}.outbox_archive (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, published_at)
                 SELECT gen_random_uuid(), 'order', 'o-' || g, 'OrderPlaced', '{{}}', '{{}}', '{}', 1, '{}'::timestamptz + g * interval '1 second'
                 FROM generate_series(1, 3000) g;",
                from.to_rfc3339(),
                (from + chrono::Duration::days(1)).to_rfc3339(),
                from.to_rfc3339(),
                from.to_rfc3339(),
            ),
        )
        .await;
        days.push(name);
    }
    exec(
        &db,
        "INSERT INTO {s}.outbox_published (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, published_at)
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'OrderPlaced', '{}', '{}', now(), 1,
                now() - CASE WHEN g <= 2500 THEN interval '8 days' ELSE interval '1 day' END
         FROM generate_series(1, 2600) g;
         CREATE TABLE {s}.deletes (n bigint NOT NULL);
         CREATE FUNCTION {s}.count_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO {s}.deletes SELECT count(*) FROM gone; RETURN NULL; END $$;
         CREATE TRIGGER count_deletes AFTER DELETE ON {s}.outbox_published
             REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {s}.count_deletes();",
    )
    .await;
    let collector = Collector::start(&broker.queue);
    let ids = db.produce(500, 50, Duration::ZERO).await;
    let relay = TestRelay::new(&db, &broker)
        .with(|c| {
            c.archive = true;
            c.archive_retention = Duration::from_secs(7 * 24 * 3600);
        })
        .start()
        .await;
    wait_until(DEADLINE, "every event archived", || async {
        db.count("outbox").await == 0 && collector.distinct() == ids.len()
    })
    .await;
    wait_until(DEADLINE, "the day past the retention dropped", || async {
        !exists(&db, &days[0]).await && db.count("outbox_published").await == 100
    })
    .await;
    relay.stop().await;
    // Today's events in today's partition; the day inside the retention
    // kept; version 1's rows past it gone, in small statements.
    let today = format!("outbox_archive_p{}", Utc::now().format("%Y%m%d"));
    assert_eq!(db.count(&today).await, 500);
    assert_eq!(db.count(&days[1]).await, 3000);
    assert_eq!(db.count("outbox_archive").await, 3500);
    let largest: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(max(n), 0) FROM \"{}\".deletes",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        (1..=1_000).contains(&largest),
        "largest DELETE: {largest} rows"
    );
    collector.stop();
    broker.cleanup().await;
    db.cleanup().await;
}
