//! The console's Failures page in a real browser (see `console.rs` for
//! the set-up): dead letters grouped by error class, event type and
//! exchange with exact counts, and one click from a group to the Dead
//! letters page filtered to exactly that group.

use e2e::TestDb;

use e2e::browser::Browser;
use e2e::console::*;

/// On the Failures page: the first row of breakdown `table` is `key` with
/// `n` dead letters; its link lands on the Dead letters page counting `n`
/// and naming `filter` (the field and value it filters on).
async fn first_group_links_to_its_dead_letters(
    browser: &Browser,
    console: &Console,
    table: &str,
    (key, n): (&str, &str),
    filter: &str,
) {
    browser.goto(&format!("{}/failures", console.url)).await;
    let row = format!("#{table} tbody tr:nth-child(1)");
    assert_eq!(browser.attr(&row, "data-key").await.as_deref(), Some(key));
    assert_eq!(
        browser.text(&format!("{row} td.count")).await,
        n,
        "{table}: {key}"
    );
    browser.click(&format!("{row} a.group")).await;
    assert_eq!(
        browser.text("#matching-count").await,
        n,
        "{table}: {key}'s dead letters"
    );
    let said = browser.text("#matching").await;
    assert!(said.contains(filter), "{said:?} should name {filter:?}");
    let url = browser.client.current_url().await.expect("url");
    assert!(url.path().ends_with("/dead-letters"), "{url}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_failures_groups_dead_letters_and_one_click_filters_the_list_to_a_group() {
    let db = TestDb::producer("console_failures").await;
    failure_mix(&db).await;
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;

    browser.goto(&format!("{}/failures", console.url)).await;
    assert_eq!(browser.text("h1").await, "Failures");
    assert_eq!(browser.text("#failures-total").await, "10");
    let classes = browser.text("#by-error-class tbody").await;
    for (class, n) in [
        (NO_ROUTE_CLASS, 4),
        (TOO_LARGE_CLASS, 3),
        (REJECTED_CLASS, 2),
    ] {
        assert!(
            classes.contains(&format!("{class} {n}")),
            "{class} {n} in {classes}"
        );
    }
    let types = browser.text("#by-event-type tbody").await;
    assert!(types.contains("OrderPlaced 6 60.0%"), "{types}");
    let exchanges = browser.text("#by-exchange tbody").await;
    assert!(
        exchanges.contains("(the relay's default) 5 50.0%"),
        "{exchanges}"
    );
    assert!(exchanges.contains("billing 1 10.0%"), "{exchanges}");
    browser.screenshot("failures").await;

    first_group_links_to_its_dead_letters(
        &browser,
        &console,
        "by-error-class",
        (NO_ROUTE_CLASS, "4"),
        &format!("error class = “{NO_ROUTE_CLASS}”"),
    )
    .await;
    let rows = browser.text("#dead-letter-table tbody").await;
    assert_eq!(rows.matches("NO_ROUTE").count(), 4, "{rows}");
    browser.screenshot("failures-one-class").await;
    first_group_links_to_its_dead_letters(
        &browser,
        &console,
        "by-event-type",
        ("OrderPlaced", "6"),
        "event type = \"OrderPlaced\"",
    )
    .await;
    first_group_links_to_its_dead_letters(
        &browser,
        &console,
        "by-exchange",
        ("(the relay's default)", "5"),
        "exchange = the relay's default",
    )
    .await;
    browser.close().await;
    drop(console);
    db.cleanup().await;
}
