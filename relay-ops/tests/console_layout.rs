//! The console as an operator works through it, in headless chromium: long
//! and hostile values on every page, counts on tables never analysed,
//! paging both ways and sorting, selecting a page, and the small things
//! (a minute with only dead letters, the 404 page, read-only pages).

use std::collections::HashSet;

use e2e::TestDb;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use e2e::browser::Browser;
use e2e::console::*;

/// A legal aggregate id of 5,000 characters.
fn long_id() -> String {
    "agg-".to_owned() + &"x".repeat(4_996)
}

/// An event type with a right-to-left override in it.
const RLO_TYPE: &str = "Invoice\u{202E}txt.exe";

/// Whether the page is no wider than the window.
async fn fits(b: &Browser) -> (i64, i64) {
    let v = b
        .client
        .execute(
            "return [document.documentElement.scrollWidth, window.innerWidth];",
            vec![],
        )
        .await
        .expect("script");
    (v[0].as_i64().unwrap_or(-1), v[1].as_i64().unwrap_or(-1))
}

/// (text nodes holding U+202E, those of them outside a `bdi`).
async fn bidi_isolated(b: &Browser) -> (i64, i64) {
    let v = b
        .client
        .execute(
            "const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
             let seen = 0, loose = 0;
             while (w.nextNode()) {
               const n = w.currentNode;
               if (n.nodeValue.includes('\\u202e')) { seen++; if (!n.parentElement.closest('bdi')) loose++; }
             }
             return [seen, loose];",
            vec![],
        )
        .await
        .expect("script");
    (v[0].as_i64().unwrap_or(-1), v[1].as_i64().unwrap_or(-1))
}

async fn exec(db: &TestDb, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(
        sql.replace("{s}", &format!("\"{}\"", db.schema)),
    ))
    .execute(&db.pool)
    .await
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_long_values_wrap_and_user_text_is_isolated_on_every_page() {
    let db = TestDb::producer("console_long").await;
    let long = long_id();
    let ids = dead_letters(&db, RLO_TYPE, &long, 3, &"NO_ROUTE ".repeat(600)).await;
    exec(
        &db,
        &format!(
            "INSERT INTO {{s}}.outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, available_at)
             VALUES ('order', '{long}', '{RLO_TYPE}', '{{}}', 2, repeat('timeout ', 600), now() - interval '1 minute')"
        ),
    )
    .await;
    blocked_aggregate(&db, &long, 2).await;
    let console = Console::start(&db, |_| {}).await;
    let b = Browser::start().await;
    let pages = [
        "/".to_owned(),
        "/dead-letters".to_owned(),
        format!("/dead-letters/{}", ids[0]),
        "/blocked".to_owned(),
        "/outbox".to_owned(),
    ];
    for path in &pages {
        b.goto(&format!("{}{path}", console.url)).await;
        b.text("h1").await;
        let (width, window) = fits(&b).await;
        assert!(
            width <= window,
            "{path}: {width} px wide in a {window} px window"
        );
    }
    for path in [
        "/dead-letters".to_owned(),
        format!("/dead-letters/{}", ids[0]),
    ] {
        b.goto(&format!("{}{path}", console.url)).await;
        let (seen, loose) = bidi_isolated(&b).await;
        assert!(seen > 0, "{path}: the override is shown");
        assert_eq!(loose, 0, "{path}: text with an override outside an isolate");
    }
    // The whole value is on the detail page.
    b.goto(&format!("{}/dead-letters/{}", console.url, ids[0]))
        .await;
    assert!(b.text("#dead-letter").await.contains(&long));
    b.goto(&format!("{}/dead-letters", console.url)).await;
    b.screenshot("console-long-values").await;
    // The confirmation page, with its sample of what it touches.
    b.click("#select-all").await;
    b.click("#replay-selected").await;
    assert_eq!(
        b.attr("#confirm-count", "data-count").await.as_deref(),
        Some("3")
    );
    let sample = b
        .client
        .find_all(fantoccini::Locator::Css("#confirm-sample tbody tr"))
        .await
        .expect("sample rows");
    assert_eq!(sample.len(), 3, "the sample shows what it will touch");
    let (width, window) = fits(&b).await;
    assert!(width <= window, "confirm: {width} px in {window}");
    b.close().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_counts_on_tables_never_analysed_are_within_15_percent() {
    let db = TestDb::producer("console_unanalysed").await;
    for table in ["outbox", "outbox_dead_letters"] {
        exec(
            &db,
            &format!("ALTER TABLE {{s}}.{table} SET (autovacuum_enabled = false)"),
        )
        .await;
    }
    let (outbox, dead) = (250_000_i64, 120_000_i64);
    exec(
        &db,
        &format!(
            "INSERT INTO {{s}}.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'o-' || g, 'OrderPlaced', jsonb_build_object('order', g, 'note', repeat('x', 120))
             FROM generate_series(1, {outbox}) g"
        ),
    )
    .await;
    exec(
        &db,
        &format!(
            "INSERT INTO {{s}}.outbox_dead_letters
                 (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
                  last_error, error_history, dead_lettered_at)
             SELECT gen_random_uuid(), 'agg', 'id-' || g, 'Event', jsonb_build_object('n', g, 'note', repeat('y', 150)),
                    '{{}}', now(), 10, 'NO_ROUTE: no queue bound', '[]', now() - g * interval '1 second'
             FROM generate_series(1, {dead}) g"
        ),
    )
    .await;
    let console = Console::start(&db, |_| {}).await;
    let b = Browser::start().await;
    b.goto(&format!("{}/", console.url)).await;
    let figure = |t: String| t.replace(',', "").trim().parse::<f64>().expect("a number");
    for (id, exact) in [("#backlog", outbox), ("#dead-letters", dead)] {
        let shown = figure(b.text(id).await);
        let ratio = shown / exact as f64;
        assert!(
            (0.85..=1.15).contains(&ratio),
            "{id}: {shown} shown for {exact} rows ({ratio:.2})"
        );
    }
    // Still never analysed: the figures did not come from statistics.
    let analysed: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_class WHERE relnamespace = '\"{}\"'::regnamespace
           AND relname IN ('outbox', 'outbox_dead_letters') AND reltuples >= 0",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("pg_class");
    assert_eq!(analysed, 0, "the tables were analysed meanwhile");
    b.close().await;
    db.cleanup().await;
}

/// The ids in the dead-letter table, in page order.
async fn listed(b: &Browser) -> Vec<Uuid> {
    let v = b
        .client
        .execute(
            "return [...document.querySelectorAll('#dead-letter-table tbody a code')].map(e => e.textContent);",
            vec![],
        )
        .await
        .expect("script");
    v.as_array()
        .expect("an array")
        .iter()
        .map(|s| Uuid::parse_str(s.as_str().unwrap_or("")).expect("an id"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_pages_dead_letters_both_ways_sorts_them_and_selects_a_page() {
    let db = TestDb::producer("console_paging").await;
    let ids = dead_letters(&db, "PaymentFailed", "pay", 120, "NO_ROUTE: no queue bound").await;
    exec(
        &db,
        "UPDATE {s}.outbox_dead_letters SET attempts = 1 + (aggregate_id LIKE '%7')::int * 30",
    )
    .await;
    let console = Console::start(&db, |_| {}).await;
    let b = Browser::start().await;
    b.goto(&format!("{}/dead-letters", console.url)).await;
    let first = listed(&b).await;
    assert_eq!(first, ids[..50].to_vec(), "newest first");
    assert!(
        !b.exists("#previous-page").await,
        "no page before the first"
    );
    b.click_to_page("#next-page").await;
    b.text("#matching").await;
    let second = listed(&b).await;
    assert_eq!(second, ids[50..100].to_vec());
    b.click_to_page("#next-page").await;
    b.text("#matching").await;
    assert_eq!(listed(&b).await, ids[100..].to_vec());
    assert!(!b.exists("#next-page").await, "the last page");
    b.click_to_page("#previous-page").await;
    b.text("#matching").await;
    assert_eq!(listed(&b).await, second, "back to the second page");
    b.click_to_page("#first-page").await;
    b.text("#matching").await;
    assert_eq!(listed(&b).await, first);
    // Oldest first, and most attempts first.
    b.goto(&format!("{}/dead-letters?sort=oldest", console.url))
        .await;
    let mut oldest = ids.clone();
    oldest.reverse();
    assert_eq!(listed(&b).await, oldest[..50].to_vec());
    b.goto(&format!("{}/dead-letters?sort=attempts", console.url))
        .await;
    let most: HashSet<Uuid> = listed(&b).await[..12].iter().copied().collect();
    let want: HashSet<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| (i + 1) % 10 == 7)
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(most, want, "the 12 with 31 attempts come first");
    // Select every row on the page, then act on them.
    b.goto(&format!("{}/dead-letters", console.url)).await;
    b.click("#select-all").await;
    let checked = b
        .client
        .execute(
            "return document.querySelectorAll('input[name=ids]:checked').length;",
            vec![],
        )
        .await
        .expect("script");
    assert_eq!(checked.as_i64(), Some(50));
    b.click("#purge-selected").await;
    b.confirm_action(50, None).await;
    assert_eq!(count_where(&db, "outbox_dead_letters", "TRUE").await, 70);
    b.close().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_small_things_dead_letter_minutes_404_and_read_only_forms() {
    let db = TestDb::producer("console_small").await;
    let ids = dead_letters(&db, "PaymentFailed", "pay", 3, "NO_ROUTE: no queue bound").await;
    blocked_aggregate(&db, "acc-1", 2).await;
    exec(
        &db,
        "INSERT INTO {s}.outbox_publish_stats (minute, published, dead_lettered)
         VALUES (date_trunc('minute', now()) - interval '5 minutes', 0, 4)",
    )
    .await;
    let console = Console::start(&db, |c| {
        c.arg("--read-only");
    })
    .await;
    let b = Browser::start().await;
    b.goto(&format!("{}/", console.url)).await;
    let height = b.attr("#rate-chart rect.dead", "height").await;
    let height: f64 = height.as_deref().unwrap_or("0").parse().unwrap_or(0.0);
    assert!(
        height > 0.0,
        "a minute with only dead letters is drawn ({height})"
    );
    b.goto(&format!("{}/no-such-page", console.url)).await;
    assert_eq!(b.text("#error-title").await, "Not found");
    let styled = b
        .client
        .execute(
            "return getComputedStyle(document.querySelector('header')).backgroundColor;",
            vec![],
        )
        .await
        .expect("script");
    assert_eq!(
        styled.as_str(),
        Some("rgb(16, 24, 38)"),
        "the 404 page has the stylesheet"
    );
    for path in [
        "/dead-letters".to_owned(),
        format!("/dead-letters/{}", ids[0]),
        "/blocked".to_owned(),
    ] {
        b.goto(&format!("{}{path}", console.url)).await;
        b.text("h1").await;
        assert!(
            !b.exists("form[method=post]").await,
            "{path}: a POST form when read-only"
        );
        assert!(
            !b.exists("input[type=checkbox]").await,
            "{path}: checkboxes when read-only"
        );
    }
    b.close().await;
    db.cleanup().await;
}
