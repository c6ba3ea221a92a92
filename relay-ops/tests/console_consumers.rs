//! The console's consumer pages in a real browser, against the real
//! broker and database: queue depths, a consumer's dead-letter queue
//! (reasons, filters, replay and purge), the processed rates from the
//! inbox, and the reconciliation of the archive with the inbox. Each test
//! has its own schema and queues; a real `outbox_consumer` processes what
//! the console sends back.

use std::time::Duration;

use e2e::{TestDb, wait_until};
use lapin::BasicProperties;
use uuid::Uuid;

use e2e::browser::Browser;
use e2e::console::*;

#[path = "console_consumers/world.rs"]
mod world;

use world::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_consumers_page_without_a_broker_says_how_to_enable_it() {
    let db = TestDb::producer("console_cons_off").await;
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;
    browser.goto(&format!("{}/consumers", console.url)).await;
    assert_eq!(browser.text("h1").await, "Consumers");
    let off = browser.text("#consumers-off").await;
    assert!(
        off.contains("--amqp-url") && off.contains("--consumer-queue"),
        "{off}"
    );
    assert!(!browser.exists("#consumer-queues").await);
    browser.screenshot("consumers-off").await;
    browser.close().await;
    drop(console);
    db.cleanup().await;
}

/// 3 messages in the work queue, 2 in the retry queue, 6 dead letters (4
/// the consumer's, 2 the broker's, returned), 7 events processed now.
async fn seed_every_queue(w: &World) -> [String; 2] {
    // First, while the work queue is empty: the broker rejects its head.
    let broken = [
        w.rejected_by_the_broker("ItemBroken").await,
        w.rejected_by_the_broker("ItemBroken").await,
    ];
    for _ in 0..3 {
        w.publish(&w.queue, BasicProperties::default(), "{}").await;
    }
    let retry = format!("{}.retry", w.queue);
    let waits = BasicProperties::default().with_expiration("3600000".into());
    for _ in 0..2 {
        w.publish(&retry, waits.clone(), "{}").await;
    }
    for _ in 0..4 {
        w.dead_letter("ItemRejected", "rejected by the handler: unknown sku")
            .await;
    }
    let processed: Vec<String> = (0..7).map(|_| Uuid::new_v4().to_string()).collect();
    w.mark_processed(&processed).await;
    broken
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_consumers_page_shows_depths_rates_and_dead_letters_with_their_reasons() {
    let w = World::new("console_cons_depths").await;
    let broken = seed_every_queue(&w).await;
    let console = w.console(&[]).await;
    let browser = Browser::start().await;

    // A quorum queue's count in a passive declare lags its publishes by a
    // moment: the page shows it once the broker does.
    wait_until(Duration::from_secs(20), "the queue depths", || async {
        browser.goto(&format!("{}/consumers", console.url)).await;
        let at = |id| browser.attr(id, "data-count");
        (
            at("#work-0").await,
            at("#retry-0").await,
            at("#dlq-0").await,
        ) == (Some("3".into()), Some("2".into()), Some("6".into()))
    })
    .await;
    // The rates come from the inbox, read in the background.
    wait_until(Duration::from_secs(20), "the processed rate", || async {
        browser.goto(&format!("{}/consumers", console.url)).await;
        browser
            .exists("tr[data-consumer='stock'] td.processed[data-count='7']")
            .await
    })
    .await;
    browser.screenshot("consumers").await;

    browser.click("#consumer-queues a").await;
    assert_eq!(browser.text("#matching-count").await, "6");
    let rows = browser.text("#dlq-table tbody").await;
    assert!(
        rows.contains("rejected by the handler: unknown sku"),
        "{rows}"
    );
    assert!(
        rows.contains(&format!("x-death: rejected (from {})", w.queue)),
        "{rows}"
    );
    browser
        .type_into("input[name=reason_words]", "UNKNOWN SKU")
        .await;
    browser.click_to_page("#apply-filter").await;
    assert_eq!(browser.text("#matching-count").await, "4");
    assert!(
        !browser
            .text("#dlq-table tbody")
            .await
            .contains("ItemBroken")
    );
    browser.screenshot("consumer-dead-letters").await;
    browser
        .goto(&format!(
            "{}/consumers/dlq?queue={}&event_type=ItemBroken",
            console.url, w.queue
        ))
        .await;
    assert_eq!(browser.text("#matching-count").await, "2");
    let rows = browser.text("#dlq-table tbody").await;
    assert!(broken.iter().all(|id| rows.contains(id.as_str())), "{rows}");
    w.expect_depth(&w.dlq(), 6).await;
    browser.close().await;
    drop(console);
    w.cleanup().await;
}

async fn dead_letters_of(w: &World, n: usize, reason: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(w.dead_letter("PaymentTaken", reason).await);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_replays_and_purges_exactly_the_confirmed_consumer_dead_letters() {
    let w = World::new("console_cons_replay").await;
    let failed = dead_letters_of(&w, 5, "handler failed: database down").await;
    dead_letters_of(&w, 3, "undecodable body").await;
    // One of them was applied before (a crash after its commit): the inbox
    // keeps the replay from applying it twice.
    w.mark_processed(&failed[4..]).await;
    let running = w.run_consumer().await;
    let console = w.console(&[]).await;
    let browser = Browser::start().await;
    let dlq_page = format!("{}/consumers/dlq?queue={}", console.url, w.queue);

    browser.goto(&dlq_page).await;
    assert_eq!(browser.text("#matching-count").await, "8");
    for id in &failed[..2] {
        browser
            .click(&format!("input[name=ids][value='{id}']"))
            .await;
    }
    browser.click("#replay-selected").await;
    browser
        .confirm_action(2, Some("consumer-dead-letters-confirm"))
        .await;
    w.expect_depth(&w.dlq(), 6).await;

    browser
        .goto(&format!("{dlq_page}&reason_words=database+down"))
        .await;
    assert_eq!(browser.text("#matching-count").await, "3");
    browser.click("#replay-matching").await;
    browser.confirm_action(3, None).await;
    browser.screenshot("consumer-dead-letters-replayed").await;
    wait_until(
        Duration::from_secs(60),
        "the replayed events processed",
        || async { w.processed(&failed).await == 5 },
    )
    .await;
    let calls = running.calls();
    assert!(
        failed[..4].iter().all(|id| calls.get(id) == Some(&1)),
        "each once: {calls:?}"
    );
    assert_eq!(
        calls.len(),
        4,
        "the inbox skipped the one applied before, and only these: {calls:?}"
    );

    browser
        .goto(&format!("{dlq_page}&reason_words=undecodable"))
        .await;
    browser.click("#purge-matching").await;
    browser.confirm_action(3, None).await;
    w.expect_depth(&w.dlq(), 0).await;
    w.expect_depth(&w.queue, 0).await;
    let log = console.log();
    let audited = [
        "outbox_console_audit",
        "replay consumer dead letters",
        "purge consumer dead letters",
    ];
    assert!(audited.iter().all(|a| log.contains(a)), "{log}");
    running.stop.cancel();
    browser.close().await;
    drop(console);
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_consumer_actions_refuse_forged_posts() {
    let w = World::new("console_cons_csrf").await;
    let id = w.dead_letter("PaymentTaken", "undecodable body").await;
    w.expect_depth(&w.dlq(), 1).await;
    let console = w.console(&[]).await;
    let act = format!("{}/consumers/dlq/act", console.url);
    let purge = format!(
        "action=purge&scope=matching&queue={}&expected=1&reason=x",
        w.queue
    );
    // No CSRF token: refused.
    let (status, _) = http_request("POST", &act, &[], &purge).await;
    assert_eq!(status, 403, "no token");
    // This browser's cookie and token, from another origin: refused.
    let (_, page) = http_request("GET", &format!("{}/consumers", console.url), &[], "").await;
    let cookie = between(&page, "outbox_console_csrf=", ";").to_owned();
    let forged = [
        ("Cookie", format!("outbox_console_csrf={cookie}")),
        ("Origin", "http://evil.example".to_owned()),
    ];
    let (status, _) = http_request("POST", &act, &forged, &format!("csrf={cookie}&{purge}")).await;
    assert_eq!(status, 403, "cross-origin");
    let republish = format!("{}/reconcile/act", console.url);
    let (status, _) = http_request(
        "POST",
        &republish,
        &[],
        "consumer=stock&expected=1&reason=x",
    )
    .await;
    assert_eq!(status, 403, "the reconciliation's action too");
    w.expect_depth(&w.dlq(), 1).await;
    // The same POST from the console's own origin goes through.
    let own = [("Cookie", format!("outbox_console_csrf={cookie}"))];
    let (status, body) = http_request("POST", &act, &own, &format!("csrf={cookie}&{purge}")).await;
    assert_eq!(status, 200, "{body}");
    w.expect_depth(&w.dlq(), 0).await;
    assert_eq!(w.drain(&w.dlq()).await.len(), 0, "{id} purged");
    drop(console);
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_consumer_actions_are_refused_when_read_only() {
    let w = World::new("console_cons_ro").await;
    let id = w.dead_letter("PaymentTaken", "undecodable body").await;
    let purge = format!(
        "action=purge&scope=matching&queue={}&expected=1&reason=x",
        w.queue
    );
    let console = w.console(&["--read-only"]).await;
    let browser = Browser::start().await;
    browser
        .goto(&format!("{}/consumers/dlq?queue={}", console.url, w.queue))
        .await;
    assert_eq!(browser.text("#matching-count").await, "1");
    assert!(!browser.exists("#purge-matching").await && !browser.exists("#replay-selected").await);
    let (_, page) = http_request("GET", &format!("{}/consumers", console.url), &[], "").await;
    let cookie = between(&page, "outbox_console_csrf=", ";").to_owned();
    let own = [("Cookie", format!("outbox_console_csrf={cookie}"))];
    let (status, body) = http_request(
        "POST",
        &format!("{}/consumers/dlq/act", console.url),
        &own,
        &format!("csrf={cookie}&{purge}"),
    )
    .await;
    assert_eq!(status, 403);
    assert!(body.contains("Read-only console"), "{body}");
    w.expect_depth(&w.dlq(), 1).await;
    assert!(console.log().contains("refused an action: read-only"));
    browser.close().await;
    drop(console);
    assert_eq!(
        w.drain(&w.dlq()).await.len(),
        1,
        "nothing purged ({id} went before)"
    );
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_browsing_a_dead_letter_queue_many_times_loses_nothing() {
    // RabbitMQ 4's default: a quorum queue drops a message given back
    // more than 20 times (the DLQ has no dead-letter target). Declared
    // explicitly here, as a policy or RabbitMQ 4 would.
    let w = World::with_limited_dlq("console_cons_browse", 20).await;
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(
            w.dead_letter("PaymentTaken", &format!("failure number {i}"))
                .await,
        );
    }
    let console = w.console(&[]).await;
    let page = format!("{}/consumers/dlq?queue={}", console.url, w.queue);
    for n in 0..30 {
        let (status, body) = http_request("GET", &page, &[], "").await;
        assert_eq!(status, 200, "browse {n}: {body}");
        assert!(body.contains("data-count=\"8\""), "browse {n} sees all 8");
        let shown: Vec<&str> = ids
            .iter()
            .map(|id| id.as_str())
            .filter(|id| body.contains(id))
            .collect();
        assert_eq!(shown.len(), 8, "browse {n}");
        let first = ids
            .iter()
            .map(|id| body.find(id.as_str()).unwrap())
            .collect::<Vec<_>>();
        assert!(
            first.windows(2).all(|p| p[0] < p[1]),
            "browse {n}: in order"
        );
    }
    drop(console);
    w.expect_depth(&w.queue, 0).await;
    assert_eq!(
        w.drain(&w.dlq()).await,
        ids,
        "every message, once, in order"
    );
    w.cleanup().await;
}

/// Waits for the reconciliation's result, and checks it counts `n`.
async fn expect_missing(browser: &Browser, n: usize) {
    wait_until(Duration::from_secs(20), "the comparison", || async {
        browser.exists("#missing-count").await
    })
    .await;
    let counted = browser.attr("#missing-count", "data-count").await;
    assert_eq!(counted, Some(n.to_string()), "missing events");
}

/// The window of the last 90 to 10 minutes, events routed `order.*`.
async fn fill_window(browser: &Browser) {
    let at = |minutes| {
        (chrono::Utc::now() - chrono::Duration::minutes(minutes))
            .format("%Y-%m-%dT%H:%M")
            .to_string()
    };
    browser.type_into("input[name=since]", &at(90)).await;
    browser.type_into("input[name=until]", &at(10)).await;
    browser.type_into("input[name=binding]", "order.*").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_reconciliation_finds_the_published_unprocessed_events_and_republishes_them() {
    let w = World::new("console_cons_reconcile").await;
    let window = archived(&w.db, "OrderPlaced", 30, 60).await;
    let older = archived(&w.db, "OrderPlaced", 4, 300).await;
    let other_route = archived(&w.db, "RefundIssued", 3, 60).await;
    let missing: Vec<String> = [0, 7, 13, 21, 29]
        .iter()
        .map(|&i| window[i].clone())
        .collect();
    let done: Vec<String> = window
        .iter()
        .filter(|id| !missing.contains(id))
        .cloned()
        .collect();
    w.mark_processed(&done).await;
    let running = w.run_consumer().await;
    let console = w.console(&[]).await;
    let browser = Browser::start().await;

    browser.goto(&format!("{}/reconcile", console.url)).await;
    browser.screenshot("reconcile-form").await;
    fill_window(&browser).await;
    browser.click("#reconcile").await;
    expect_missing(&browser, 5).await;
    let listed = browser.text("#missing-table tbody").await;
    assert!(
        missing.iter().all(|id| listed.contains(id.as_str())),
        "{listed}"
    );
    let others = done.iter().chain(&older).chain(&other_route);
    assert!(
        others.filter(|id| listed.contains(id.as_str())).count() == 0,
        "{listed}"
    );
    browser.screenshot("reconcile").await;
    browser.click("#republish").await;
    browser.confirm_action(5, Some("reconcile-confirm")).await;

    wait_until(
        Duration::from_secs(60),
        "the republished events processed",
        || async { w.processed(&missing).await == 5 },
    )
    .await;
    let calls = running.calls();
    assert!(
        missing.iter().all(|id| calls.get(id) == Some(&1)),
        "each once: {calls:?}"
    );
    assert_eq!(calls.len(), 5, "nothing else: {calls:?}");
    browser.click("a[href*='/reconcile?']").await;
    expect_missing(&browser, 0).await;
    assert!(
        console.log().contains("action=\"republish\"")
            || console.log().contains("action=republish")
    );
    running.stop.cancel();
    browser.close().await;
    drop(console);
    w.cleanup().await;
}
