//! The operator reads and actions the console is built on, against a real
//! database: dead-letter filters, keyset paging, counts, filtered replay
//! and purge, the publish-rate table.

use std::collections::HashSet;

use e2e::TestDb;
use outbox_relay_ops::admin::{self, Filter, Selection};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

/// A seeded dead letter: id, event type, aggregate id, last error.
type Row = (Uuid, String, String, String);

/// 90 dead letters: three event types × three aggregates × ten, with three
/// kinds of error, one second apart (row `i` dead-lettered `i` s ago).
async fn seed(db: &TestDb) -> Vec<Row> {
    sqlx::query_as(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_dead_letters
             (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
              last_error, dead_lettered_at)
         SELECT gen_random_uuid(), 'agg', 'a-' || (i / 9 % 3), 'Type' || (i % 3),
                jsonb_build_object('i', i), '{{}}', now(), 1 + i % 5,
                (ARRAY['NO_ROUTE: no queue bound', 'broker returned 406 PRECONDITION_FAILED',
                       'timeout waiting for the confirm'])[1 + (i / 3) % 3],
                now() - i * interval '1 second'
         FROM generate_series(0, 89) i
         RETURNING id, event_type, aggregate_id, last_error",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .expect("seed")
}

fn filter(f: impl FnOnce(&mut Filter)) -> Filter {
    let mut filter = Filter::default();
    f(&mut filter);
    filter
}

#[tokio::test]
async fn dead_letter_filters_select_exactly_their_rows_and_paging_visits_each_once() {
    let db = TestDb::producer("admin_filters").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let rows = seed(&db).await;
    let expect = |pred: &dyn Fn(&Row) -> bool| -> HashSet<Uuid> {
        rows.iter().filter(|r| pred(r)).map(|r| r.0).collect()
    };
    let cases: Vec<(Filter, HashSet<Uuid>)> = vec![
        (Filter::default(), expect(&|_| true)),
        (
            filter(|f| f.event_type = Some("Type1".into())),
            expect(&|r| r.1 == "Type1"),
        ),
        (
            filter(|f| {
                f.aggregate_type = Some("agg".into());
                f.aggregate_id = Some("a-2".into());
            }),
            expect(&|r| r.2 == "a-2"),
        ),
        (
            filter(|f| f.error_words = Some("precondition_failed".into())),
            expect(&|r| r.3.contains("PRECONDITION_FAILED")),
        ),
        (
            filter(|f| f.error_words = Some("no route".into())),
            expect(&|r| r.3.starts_with("NO_ROUTE")),
        ),
        // A phrase of three words, through its pairs.
        (
            filter(|f| f.error_words = Some("no queue bound".into())),
            expect(&|r| r.3.starts_with("NO_ROUTE")),
        ),
        // Both words in every NO_ROUTE error, never in this order.
        (
            filter(|f| f.error_words = Some("queue no".into())),
            HashSet::new(),
        ),
        // Whole words only: a fragment matches nothing.
        (
            filter(|f| f.error_words = Some("PRECOND".into())),
            HashSet::new(),
        ),
        (
            filter(|f| {
                f.event_type = Some("Type0".into());
                f.error_words = Some("timeout".into());
            }),
            expect(&|r| r.1 == "Type0" && r.3.starts_with("timeout")),
        ),
    ];
    for (f, want) in &cases {
        // Pages of 7, keyset: every matching row once, newest first; and
        // back again from the last page, in the same order.
        let seen = page_through(&db, &schema, f, admin::Order::Newest).await;
        for order in [admin::Order::Oldest, admin::Order::MostAttempts] {
            let other = page_through(&db, &schema, f, order).await;
            let mut a: Vec<_> = other.iter().map(|r| r.1).collect();
            let mut b: Vec<_> = seen.iter().map(|r| r.1).collect();
            a.sort();
            b.sort();
            assert_eq!(a, b, "{f:?} {order:?}: the same rows in every order");
        }
        let ids: HashSet<Uuid> = seen.iter().map(|r| r.1).collect();
        assert_eq!(ids.len(), seen.len(), "{f:?}: a row on two pages");
        assert_eq!(&ids, want, "{f:?}");
        assert!(
            seen.windows(2).all(|w| (w[0].0, w[0].1) > (w[1].0, w[1].1)),
            "{f:?}: newest first"
        );
        let selection = Selection::Matching(f.clone());
        let n = admin::count_dead_letters(&db.pool, &schema, &selection, None)
            .await
            .unwrap();
        assert_eq!(n as usize, want.len(), "{f:?}: count");
        let capped = admin::count_dead_letters(&db.pool, &schema, &selection, Some(5))
            .await
            .unwrap();
        assert_eq!(capped as usize, want.len().min(5), "{f:?}: capped count");
        // A table this small is read whole: the estimate is the count.
        let about = admin::estimate_dead_letters(&db.pool, &schema, &selection)
            .await
            .unwrap();
        assert_eq!(
            about as usize,
            want.len(),
            "{f:?}: estimate of a small table"
        );
    }
    // A time range: rows dead-lettered between 10.5 s and 20.5 s ago.
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let since = now - chrono::Duration::milliseconds(20_500);
    let until = now - chrono::Duration::milliseconds(10_500);
    let windowed = admin::page_dead_letters(
        &db.pool,
        &schema,
        &filter(|f| {
            f.since = Some(since);
            f.until = Some(until);
        }),
        admin::Order::Newest,
        admin::PageAt::First,
        100,
    )
    .await
    .unwrap()
    .rows;
    assert!(
        !windowed.is_empty() && windowed.len() <= 11,
        "{}",
        windowed.len()
    );
    assert!(
        windowed
            .iter()
            .all(|d| d.dead_lettered_at >= since && d.dead_lettered_at < until)
    );
    db.cleanup().await;
}

#[tokio::test]
async fn filtered_replay_and_purge_touch_only_the_matching_dead_letters() {
    let db = TestDb::producer("admin_actions").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let rows = seed(&db).await;
    let type2: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.1 == "Type2")
        .map(|r| r.0)
        .collect();
    let replayed = admin::replay_dead_letters(
        &db.pool,
        &schema,
        &Selection::Matching(filter(|f| f.event_type = Some("Type2".into()))),
        std::time::Duration::from_secs(3600),
        Some(type2.len() as u64),
    )
    .await
    .unwrap();
    assert_eq!(replayed.replayed as usize, type2.len());
    assert_eq!(replayed.ids.iter().copied().collect::<HashSet<_>>(), type2);
    let in_outbox: HashSet<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM \"{}\".outbox",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(in_outbox, type2, "exactly the matching events are back");
    let no_route = rows
        .iter()
        .filter(|r| r.1 != "Type2" && r.3.starts_with("NO_ROUTE"))
        .count();
    let selection = Selection::Matching(filter(|f| f.error_words = Some("NO_ROUTE".into())));
    // Confirmed fewer than match now: refused, nothing deleted.
    let grew = admin::purge_dead_letters(&db.pool, &schema, &selection, Some(no_route as u64 - 1))
        .await
        .unwrap_err();
    assert!(
        matches!(grew, outbox_relay_ops::admin::Error::SelectionGrew { found, .. } if found as usize == no_route),
        "{grew}"
    );
    assert_eq!(
        db.count("outbox_dead_letters").await as usize,
        rows.len() - type2.len()
    );
    let replay_grew = admin::replay_dead_letters(
        &db.pool,
        &schema,
        &selection,
        std::time::Duration::from_secs(3600),
        Some(1),
    )
    .await
    .unwrap_err();
    assert!(matches!(
        replay_grew,
        outbox_relay_ops::admin::Error::SelectionGrew { .. }
    ));
    assert_eq!(
        db.count("outbox").await as usize,
        type2.len(),
        "nothing replayed"
    );
    let purged = admin::purge_dead_letters(&db.pool, &schema, &selection, Some(no_route as u64))
        .await
        .unwrap();
    assert_eq!(purged.len(), no_route);
    assert_eq!(
        db.count("outbox_dead_letters").await as usize,
        rows.len() - type2.len() - no_route
    );
    db.cleanup().await;
}

#[tokio::test]
async fn a_big_outbox_is_estimated_at_its_current_size_not_its_last_analyze() {
    let db = TestDb::producer("admin_estimate").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let s = format!("\"{}\"", db.schema);
    let fill = format!(
        "INSERT INTO {s}.outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'o-' || g, 'OrderPlaced', jsonb_build_object('g', g, 'pad', repeat('x', 200))
         FROM generate_series(1, 120000) g"
    );
    // No autovacuum: the statistics are exactly those of the ANALYZE below.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {s}.outbox SET (autovacuum_enabled = false); {fill}; ANALYZE {s}.outbox; {fill}"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    // 240,000 rows now, 120,000 at the last ANALYZE: above the exact-count
    // bound, so estimated, at the table's current size.
    let backlog = admin::gauges(&db.pool, &schema).await.unwrap().backlog;
    assert!(
        (204_000..=276_000).contains(&backlog),
        "estimated {backlog} rows of 240,000"
    );
    let by_type = admin::backlog_by_type(&db.pool, &schema).await.unwrap();
    assert!(!by_type.exact);
    let sampled: i64 = by_type.types.iter().map(|t| t.events).sum();
    assert!(
        (204_000..=276_000).contains(&sampled),
        "sampled {sampled} of 240,000"
    );
    db.cleanup().await;
}

/// Every row matching `f` in `order`, by pages of 7 forwards, checked
/// against the same pages walked backwards from the last: (time, id,
/// attempts) in list order.
async fn page_through(
    db: &TestDb,
    schema: &outbox::Ident,
    f: &Filter,
    order: admin::Order,
) -> Vec<(chrono::DateTime<chrono::Utc>, Uuid, i32)> {
    let key = |d: &admin::DeadLetter| (d.dead_lettered_at, d.id, d.attempts);
    let mut pages: Vec<Vec<_>> = Vec::new();
    let mut at = admin::PageAt::First;
    loop {
        assert!(pages.len() <= 90 / 7 + 1, "{f:?}: paging does not end");
        let page = admin::page_dead_letters(&db.pool, schema, f, order, at, 7)
            .await
            .unwrap();
        assert_eq!(
            page.has_previous,
            !pages.is_empty(),
            "{f:?} {order:?}: previous"
        );
        let Some(last) = page.rows.last() else { break };
        at = admin::PageAt::After(last.into());
        pages.push(page.rows.iter().map(key).collect());
        if !page.has_next {
            break;
        }
    }
    // Backwards from the last page: the same pages, in reverse.
    for i in (0..pages.len().saturating_sub(1)).rev() {
        let first = pages[i + 1][0];
        let before = admin::Cursor {
            dead_lettered_at: first.0,
            id: first.1,
            attempts: first.2,
        };
        let page =
            admin::page_dead_letters(&db.pool, schema, f, order, admin::PageAt::Before(before), 7)
                .await
                .unwrap();
        let got: Vec<_> = page.rows.iter().map(key).collect();
        assert_eq!(got, pages[i], "{f:?} {order:?}: page {i} backwards");
        assert_eq!(
            page.has_previous,
            i > 0,
            "{f:?} {order:?}: previous of page {i}"
        );
        assert!(page.has_next, "{f:?} {order:?}: next of page {i}");
    }
    let all: Vec<_> = pages.concat();
    let sorted = match order {
        admin::Order::Oldest => all.windows(2).all(|w| (w[0].0, w[0].1) < (w[1].0, w[1].1)),
        admin::Order::MostAttempts => all
            .windows(2)
            .all(|w| (w[0].2, w[0].0, w[0].1) > (w[1].2, w[1].0, w[1].1)),
        _ => true,
    };
    assert!(sorted, "{f:?} {order:?}: out of order");
    all
}

/// The estimate a confirmation shows for a selection too large to count
/// while the page waits: from a sample of the table's pages, within 15%
/// of the count, for a phrase and for an event type, on a table several
/// times the sample.
#[tokio::test]
async fn a_large_selection_is_estimated_from_a_sample_within_15_percent() {
    let db = TestDb::producer("admin_estimate").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_dead_letters
             (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
              last_error, dead_lettered_at)
         SELECT gen_random_uuid(), 'agg', 'a-' || i, 'Type' || (i % 4),
                jsonb_build_object('i', i, 'note', repeat('x', 600)), '{{}}', now(), 1,
                (ARRAY['NO_ROUTE: no queue bound', 'timeout waiting for the broker''s confirm',
                       'nacked by the broker'])[1 + i % 3],
                now() - i * interval '1 second'
         FROM generate_series(0, 29999) i",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .expect("seed");
    let pages: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_relation_size('\"{}\".outbox_dead_letters') / 8192",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        pages > 2_000,
        "the table ({pages} pages) is larger than the sample"
    );
    for f in [
        filter(|f| f.error_words = Some("waiting for the broker".into())),
        filter(|f| f.event_type = Some("Type3".into())),
        Filter::default(),
    ] {
        let selection = Selection::Matching(f.clone());
        let exact = admin::count_dead_letters(&db.pool, &schema, &selection, None)
            .await
            .unwrap();
        let about = admin::estimate_dead_letters(&db.pool, &schema, &selection)
            .await
            .unwrap();
        let ratio = about as f64 / exact as f64;
        assert!(
            (0.85..=1.15).contains(&ratio),
            "{f:?}: estimated {about} of {exact}"
        );
    }
    db.cleanup().await;
}

/// A replay is one more entry in the event's error history, kept to its
/// last 20 like every failure the relay records (before, a replay added
/// one past the cap).
#[tokio::test]
async fn a_replay_keeps_the_last_20_entries_of_the_error_history() {
    let db = TestDb::producer("admin_replay_history").await;
    let schema = outbox::Ident::new("schema", &db.schema).unwrap();
    let id: Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_dead_letters
             (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
              last_error, error_history)
         SELECT gen_random_uuid(), 'agg', 'a-1', 'Type', '{{}}', '{{}}', now(), 20, 'failure 20',
                jsonb_agg(jsonb_build_object('at', now(), 'error', 'failure ' || i) ORDER BY i)
         FROM generate_series(1, 20) i
         RETURNING id",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let replayed = admin::replay_dead_letters(
        &db.pool,
        &schema,
        &Selection::Ids(vec![id]),
        std::time::Duration::from_secs(3600),
        Some(1),
    )
    .await
    .unwrap();
    assert_eq!(replayed.ids, [id]);
    let errors: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT e->>'error' FROM \"{}\".outbox, jsonb_array_elements(error_history) e
         WHERE id = $1",
        db.schema
    )))
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors.len(), 20, "{errors:?}");
    assert_eq!(errors[0], "failure 2", "the oldest entry went");
    assert_eq!(errors[19], "replayed from dead letters");
    db.cleanup().await;
}
