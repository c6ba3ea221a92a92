//! The operator console (`outbox-relay console`) in a real browser:
//! Debian's chromium, headless, driven through chromedriver (WebDriver;
//! `make browser` installs both). Each test runs its own console process
//! on its own schema, and saves screenshots under
//! `target/console-screenshots/`.

use std::time::{Duration, Instant};

use e2e::{Collector, KillOnDrop, TestBroker, TestDb, wait_until};
use lapin::types::FieldTable;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use e2e::browser::Browser;
use e2e::console::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_overview_shows_the_outbox_with_real_numbers() {
    let db = TestDb::producer("console_overview").await;
    db.produce(25, 5, Duration::ZERO).await;
    dead_letters(&db, "PaymentFailed", "p", 7, "NO_ROUTE: no queue bound").await;
    blocked_aggregate(&db, "a-1", 3).await;
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;

    browser.goto(&format!("{}/", console.url)).await;
    assert_eq!(browser.text("h1").await, "Overview");
    // 25 unordered + 3 ordered events; 7 dead letters; one blocked aggregate.
    assert_eq!(browser.text("#backlog").await, "28");
    assert_eq!(browser.text("#dead-letters").await, "7");
    assert_eq!(browser.text("#blocked").await, "1");
    assert!(
        browser.exists("#rate-chart").await,
        "the publish-rate chart"
    );
    browser.screenshot("overview").await;

    // The overview refreshes by itself: a change shows without a reload.
    dead_letters(&db, "PaymentFailed", "q", 2, "NO_ROUTE: no queue bound").await;
    wait_until(
        Duration::from_secs(20),
        "the overview to refresh",
        || async { browser.text("#dead-letters").await == "9" },
    )
    .await;

    browser.goto(&format!("{}/outbox", console.url)).await;
    let by_type = browser.text("#backlog-by-type").await;
    assert!(by_type.contains("order OrderPlaced 25"), "{by_type}");
    assert!(by_type.contains("account AccountEvent1 1"), "{by_type}");
    assert!(browser.text("#oldest-due").await.contains("OrderPlaced"));
    browser.screenshot("outbox").await;

    browser.goto(&format!("{}/blocked", console.url)).await;
    let card = browser.text("div.blocked").await;
    assert!(card.contains("account / a-1"), "{card}");
    assert!(card.contains("NO_ROUTE: nobody listens"), "{card}");
    assert!(
        card.contains("2 event(s): #2 AccountEvent2, #3 AccountEvent3"),
        "{card}"
    );
    // No page shows the database password or any credential.
    let source = browser.client.source().await.expect("source");
    assert!(!source.contains("password"), "a page mentions a password");
    browser.close().await;
    drop(console);
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_filtered_replay_moves_exactly_the_matching_dead_letters_and_the_relay_publishes_them()
 {
    let db = TestDb::producer("console_replay").await;
    let broker = TestBroker::new("console_replay", FieldTable::default()).await;
    let wanted = dead_letters(&db, "PaymentFailed", "p", 12, "NO_ROUTE: no queue bound").await;
    let others = dead_letters(&db, "RefundFailed", "r", 18, "timeout waiting for confirms").await;
    let collector = Collector::start(&broker.queue);
    let _relay = start_relay(&db, &broker);
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;

    browser.goto(&format!("{}/dead-letters", console.url)).await;
    assert_eq!(browser.text("#matching-count").await, "30");
    browser
        .type_into("input[name=event_type]", "PaymentFailed")
        .await;
    browser.click_to_page("#apply-filter").await;
    assert_eq!(browser.text("#matching-count").await, "12");
    let rows = browser.text("#dead-letter-table tbody").await;
    assert!(
        rows.contains("PaymentFailed") && !rows.contains("RefundFailed"),
        "{rows}"
    );
    browser.screenshot("dead-letters-filtered").await;

    browser.click("#replay-matching").await;
    browser
        .confirm_action(12, Some("dead-letters-confirm"))
        .await;

    // Exactly the matching ones left the dead letters...
    assert_eq!(
        count_where(&db, "outbox_dead_letters", "event_type = 'PaymentFailed'").await,
        0
    );
    assert_eq!(
        count_where(&db, "outbox_dead_letters", "event_type = 'RefundFailed'").await,
        18
    );
    // ...and the relay published them: each on the broker, nothing else.
    wait_until(
        Duration::from_secs(60),
        "the replayed events on the broker",
        || async { wanted.iter().all(|id| collector.has(&id.to_string())) },
    )
    .await;
    wait_until(Duration::from_secs(30), "the outbox to empty", || async {
        db.count("outbox").await == 0
    })
    .await;
    collector.drain(Duration::from_secs(30)).await;
    assert_eq!(
        collector.distinct(),
        12,
        "only the replayed events were published"
    );
    assert!(others.iter().all(|id| !collector.has(&id.to_string())));

    // The action is in the audit log, with what it touched.
    let log = console.log();
    assert!(
        log.contains("outbox_console_audit")
            && log.contains("replayed=12")
            && log.contains("PaymentFailed"),
        "audit log: {log}"
    );
    // The relay recorded its rate: the overview's last hour counts them.
    browser.goto(&format!("{}/", console.url)).await;
    wait_until(
        Duration::from_secs(30),
        "the published count on the overview",
        || async { browser.text("#published-hour").await == "12" },
    )
    .await;
    assert!(
        browser.text("#relay-table").await.contains("64"),
        "the relay holds every partition"
    );
    browser.screenshot("overview-after-replay").await;
    browser.close().await;
    drop(console);
    broker.cleanup().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_skip_unblocks_an_ordered_aggregate() {
    let db = TestDb::producer("console_skip").await;
    let broker = TestBroker::new("console_skip", FieldTable::default()).await;
    let ids = blocked_aggregate(&db, "a-7", 4).await;
    let collector = Collector::start(&broker.queue);
    let _relay = start_relay(&db, &broker);
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;

    browser.goto(&format!("{}/blocked", console.url)).await;
    assert_eq!(browser.text("#blocked-count").await, "1");
    assert_eq!(
        browser.text("div.blocked code.event-id").await,
        ids[0].to_string()
    );
    browser.screenshot("blocked").await;
    // Skipping needs a reason.
    browser.click("div.blocked button.skip").await;
    assert_eq!(browser.text("#error-title").await, "A reason is required");
    assert_eq!(
        db.count("outbox").await,
        4,
        "nothing skipped without a reason"
    );

    browser.goto(&format!("{}/blocked", console.url)).await;
    browser
        .type_into(
            "div.blocked input.reason",
            "bad payload, fixed by hand in ticket 42",
        )
        .await;
    browser.click("div.blocked button.skip").await;
    assert!(
        browser
            .text("#result")
            .await
            .contains("moved to the dead letters")
    );

    // The head is a dead letter with the reason; the three behind it go out.
    let error: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT last_error FROM \"{}\".outbox_dead_letters WHERE id = $1",
        db.schema
    )))
    .bind(ids[0])
    .fetch_one(&db.pool)
    .await
    .expect("the skipped event is a dead letter");
    assert!(
        error.contains("bad payload, fixed by hand in ticket 42"),
        "{error}"
    );
    wait_until(
        Duration::from_secs(60),
        "the aggregate's later events on the broker",
        || async { ids[1..].iter().all(|id| collector.has(&id.to_string())) },
    )
    .await;
    assert!(
        !collector.has(&ids[0].to_string()),
        "the skipped event is not published"
    );
    browser.goto(&format!("{}/blocked", console.url)).await;
    wait_until(
        Duration::from_secs(20),
        "the blocked list to empty",
        || async {
            browser.goto(&format!("{}/blocked", console.url)).await;
            browser.exists("#no-blocked").await
        },
    )
    .await;
    let log = console.log();
    assert!(
        log.contains("action=\"skip\"") || log.contains("action=skip"),
        "audit log: {log}"
    );
    browser.close().await;
    drop(console);
    broker.cleanup().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_refuses_a_non_loopback_address_without_credentials_and_requests_without_them() {
    let db = TestDb::producer("console_auth").await;
    dead_letters(&db, "PaymentFailed", "p", 3, "NO_ROUTE").await;

    // No credentials on a non-loopback address: it does not start.
    let port = free_port();
    let log = artifacts("console-logs").join(format!("{}-refused.log", db.schema));
    let mut refused = KillOnDrop(
        console_cmd(&db, &format!("0.0.0.0:{port}"), &log)
            .spawn()
            .expect("console"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = refused.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "a console without credentials kept running on 0.0.0.0"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success());
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        said.contains("refusing to serve the console on 0.0.0.0"),
        "{said}"
    );

    // With a token on 0.0.0.0: the browser without it is refused. (A
    // basic-auth challenge would open chromium's sign-in prompt instead of
    // a page, so basic auth is checked over plain HTTP below.)
    let token = format!("tok-{}", Uuid::new_v4().simple());
    let port = free_port();
    let log = artifacts("console-logs").join(format!("{}-token.log", db.schema));
    let mut cmd = console_cmd(&db, &format!("0.0.0.0:{port}"), &log);
    cmd.env("OUTBOX_CONSOLE_TOKEN", &token);
    let _console = KillOnDrop(cmd.spawn().expect("console"));
    wait_for_port(port, "the console to listen").await;
    let password = format!("pw-{}", Uuid::new_v4().simple());
    let basic_port = free_port();
    let basic_log = artifacts("console-logs").join(format!("{}-basic.log", db.schema));
    let mut cmd = console_cmd(&db, &format!("0.0.0.0:{basic_port}"), &basic_log);
    cmd.env("OUTBOX_CONSOLE_PASSWORD", &password)
        .env("OUTBOX_CONSOLE_USER", "ops");
    let _basic_console = KillOnDrop(cmd.spawn().expect("console"));
    wait_for_port(basic_port, "the basic-auth console to listen").await;
    let browser = Browser::start().await;
    browser
        .goto(&format!("http://127.0.0.1:{port}/dead-letters"))
        .await;
    assert_eq!(browser.text("#error-title").await, "Sign-in required");
    assert!(!browser.exists("#dead-letter-table").await);
    browser.screenshot("unauthenticated").await;
    browser.close().await;

    // Over plain HTTP: no credentials or wrong ones get 401; the right
    // token or user and password get the page.
    let get = |port: u16, auth: Option<String>| {
        let url = format!("http://127.0.0.1:{port}/dead-letters");
        async move { http_get(&url, auth).await }
    };
    use base64::Engine;
    let basic = |u: &str, p: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
        )
    };
    assert_eq!(get(port, None).await.0, 401);
    assert_eq!(get(port, Some("Bearer wrong".into())).await.0, 401);
    assert_eq!(get(port, Some(format!("Bearer {token}x"))).await.0, 401);
    let (status, body) = get(port, Some(format!("Bearer {token}"))).await;
    assert_eq!(status, 200);
    assert!(body.contains("PaymentFailed"));
    let (status, refused) = get(basic_port, None).await;
    assert_eq!(status, 401);
    assert!(
        refused.contains("WWW-Authenticate: Basic") || refused.contains("www-authenticate: Basic")
    );
    assert_eq!(get(basic_port, Some(basic("ops", "wrong"))).await.0, 401);
    assert_eq!(get(basic_port, Some(basic("root", &password))).await.0, 401);
    assert_eq!(
        get(basic_port, Some(format!("Bearer {password}"))).await.0,
        401
    );
    let (status, body_basic) = get(basic_port, Some(basic("ops", &password))).await;
    assert_eq!(status, 200);
    assert!(
        !body_basic.contains("; Secure"),
        "plain HTTP: no Secure cookie"
    );
    // Behind a TLS-terminating proxy the CSRF cookie is Secure.
    let (status, behind_tls) = http_request(
        "GET",
        &format!("http://127.0.0.1:{basic_port}/dead-letters"),
        &[
            ("Authorization", basic("ops", &password)),
            ("X-Forwarded-Proto", "https".to_owned()),
        ],
        "",
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        behind_tls.contains("HttpOnly; SameSite=Strict; Secure"),
        "{behind_tls}"
    );
    // Neither secret is ever printed.
    let said = std::fs::read_to_string(&log).unwrap_or_default()
        + &std::fs::read_to_string(&basic_log).unwrap_or_default();
    assert!(said.contains("console listening"), "{said}");
    assert!(
        !said.contains(&token) && !said.contains(&password),
        "{said}"
    );
    assert!(!body.contains(&token) && !body_basic.contains(&password));
    db.cleanup().await;
}

/// `GET url` with an optional `Authorization` header: (status, body).
async fn http_get(url: &str, authorization: Option<String>) -> (u16, String) {
    let auth = authorization.map(|a| ("Authorization", a));
    http_request("GET", url, auth.as_slice(), "").await
}

/// The hidden fields of the form `id` in `page`, URL-encoded as its POST.
fn form_body(page: &str, id: &str) -> String {
    let form = between(page, &format!("id=\"{id}\""), "</form>");
    let mut body = url::form_urlencoded::Serializer::new(String::new());
    for input in form.split("<input").skip(1) {
        if !input.contains("type=\"hidden\"") {
            continue;
        }
        let name = between(input, "name=\"", "\"");
        let value = between(input, "value=\"", "\"").replace("&amp;", "&");
        body.append_pair(name, &value);
    }
    body.finish()
}

/// A selection too large to count while the page waits: the confirmation
/// says more than 1,000 and about how many; the action takes every match
/// dead-lettered before the confirmation and none that came after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_confirms_a_selection_too_large_to_count_and_acts_on_what_was_confirmed() {
    let db = TestDb::producer("console_large").await;
    let error = "timeout waiting for the broker's confirm";
    dead_letters(&db, "Big", "b", 1_500, error).await;
    dead_letters(&db, "Small", "s", 5, error).await;
    let console = Console::start(&db, |_| {}).await;
    let (_, page) = http_request("GET", &format!("{}/dead-letters", console.url), &[], "").await;
    let cookie = between(&page, "outbox_console_csrf=", ";").to_owned();
    let headers = [("Cookie", format!("outbox_console_csrf={cookie}"))];
    let (status, confirm) = http_request(
        "POST",
        &format!("{}/dead-letters/confirm", console.url),
        &headers,
        &format!(
            "csrf={cookie}&action=purge&scope=matching&event_type=Big&error=waiting+for+the+broker"
        ),
    )
    .await;
    assert_eq!(status, 200, "{confirm}");
    assert!(
        confirm.contains("more than <strong>1,000</strong> (about 1,500"),
        "{confirm}"
    );
    // Dead letters that match but arrive after the confirmation.
    let late = dead_letters(&db, "Big", "late", 7, error).await;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox_dead_letters SET dead_lettered_at = clock_timestamp() WHERE id = ANY($1)",
        db.schema
    )))
    .bind(&late)
    .execute(&db.pool)
    .await
    .unwrap();
    let act = format!("{}/dead-letters/act", console.url);
    let body = form_body(&confirm, "confirm-form");
    assert!(body.contains("expected=more"), "{body}");
    let (status, done) =
        http_request("POST", &act, &headers, &format!("{body}&reason=cleanup")).await;
    assert_eq!(status, 200, "{done}");
    assert!(
        done.contains("Purged <strong>1500</strong>") && done.contains("confirmed more than 1,000"),
        "{done}"
    );
    assert_eq!(
        count_where(&db, "outbox_dead_letters", "event_type = 'Big'").await,
        7
    );
    assert_eq!(
        count_where(&db, "outbox_dead_letters", "event_type = 'Small'").await,
        5
    );
    // "More" stands only for a filter pinned to its confirmation time.
    let ids = format!(
        "csrf={cookie}&action=purge&scope=ids&ids={}&expected=more&reason=x",
        late[0]
    );
    let (status, _) = http_request("POST", &act, &headers, &ids).await;
    assert_eq!(status, 400, "an id selection confirms its count");
    assert_eq!(
        count_where(&db, "outbox_dead_letters", "event_type = 'Big'").await,
        7
    );
    drop(console);
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_refuses_a_forged_post_and_any_action_when_read_only() {
    let db = TestDb::producer("console_csrf").await;
    dead_letters(&db, "PaymentFailed", "p", 5, "NO_ROUTE").await;
    let console = Console::start(&db, |_| {}).await;
    let browser = Browser::start().await;
    browser.goto(&format!("{}/dead-letters", console.url)).await;
    assert!(browser.exists("#purge-matching").await);

    // A form another page could submit: the right action, no token.
    let forge = |base: &str, token: Option<&str>| {
        let field = token.map_or(String::new(), |t| format!("add('csrf', '{t}');"));
        format!(
            "const f = document.createElement('form'); f.method = 'post'; f.action = '{base}/dead-letters/act';
             const add = (n, v) => {{ const i = document.createElement('input'); i.name = n; i.value = v; f.appendChild(i); }};
             add('action', 'purge'); add('scope', 'matching'); {field}
             document.body.appendChild(f); f.submit();"
        )
    };
    browser
        .client
        .execute(&forge(&console.url, None), vec![])
        .await
        .expect("submit");
    assert_eq!(browser.text("#error-title").await, "Request refused");
    browser.screenshot("forged-post").await;
    browser.goto(&format!("{}/dead-letters", console.url)).await;
    // Another site's page POSTing with this browser's cookie and token
    // (as if it had them) is still refused: its Origin gives it away.
    let (_, page) = http_request("GET", &format!("{}/dead-letters", console.url), &[], "").await;
    let cookie = between(&page, "outbox_console_csrf=", ";").to_owned();
    let purge = format!(
        "csrf={cookie}&action=purge&scope=matching&until=2099-01-01T00:00:00Z&expected=5&reason=x"
    );
    let with = |origin: &str| {
        vec![
            ("Cookie", format!("outbox_console_csrf={cookie}")),
            ("Origin", origin.to_owned()),
        ]
    };
    let act = format!("{}/dead-letters/act", console.url);
    let (status, _) = http_request("POST", &act, &with("http://evil.example"), &purge).await;
    assert_eq!(status, 403, "a cross-origin POST");
    let (status, _) = http_request("POST", &act, &with("http://127.0.0.1:1"), &purge).await;
    assert_eq!(status, 403, "another local port is another origin");
    // Without credentials the console answers only direct loopback
    // requests: a DNS name pointed at 127.0.0.1 (rebinding) or a proxy is refused.
    let overview = format!("{}/", console.url);
    let (status, _) = http_request(
        "GET",
        &overview,
        &[("Host", "evil.example:80".to_owned())],
        "",
    )
    .await;
    assert_eq!(status, 403, "a non-loopback Host");
    let (status, _) = http_request(
        "GET",
        &overview,
        &[("X-Forwarded-For", "203.0.113.9".to_owned())],
        "",
    )
    .await;
    assert_eq!(status, 403, "a proxied request");
    assert_eq!(db.count("outbox_dead_letters").await, 5, "nothing purged");
    let wrong = "0".repeat(64);
    browser
        .client
        .execute(&forge(&console.url, Some(&wrong)), vec![])
        .await
        .expect("submit");
    assert_eq!(browser.text("#error-title").await, "Request refused");
    assert_eq!(db.count("outbox_dead_letters").await, 5, "nothing purged");

    // The same purge through the page's own form goes through (the check
    // above refused the token, not the action).
    browser.goto(&format!("{}/dead-letters", console.url)).await;
    browser.click("#purge-matching").await;
    browser.confirm_action(5, None).await;
    assert_eq!(db.count("outbox_dead_letters").await, 0);
    browser.close().await;
    drop(console);

    // Read-only: no action buttons, and a POST is refused whatever it carries.
    dead_letters(&db, "PaymentFailed", "p", 2, "NO_ROUTE").await;
    let console = Console::start(&db, |c| {
        c.arg("--read-only");
    })
    .await;
    let browser = Browser::start().await;
    browser.goto(&format!("{}/dead-letters", console.url)).await;
    assert_eq!(browser.text("#matching-count").await, "2");
    assert!(!browser.exists("#purge-matching").await && !browser.exists("#replay-selected").await);
    browser.screenshot("read-only").await;
    browser
        .client
        .execute(&forge(&console.url, None), vec![])
        .await
        .expect("submit");
    assert_eq!(browser.text("#error-title").await, "Read-only console");
    assert_eq!(db.count("outbox_dead_letters").await, 2);
    browser.close().await;
    drop(console);
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_serves_under_a_base_path_for_a_reverse_proxy() {
    let db = TestDb::producer("console_prefix").await;
    let ids = dead_letters(&db, "PaymentFailed", "p", 3, "NO_ROUTE").await;
    // Behind a proxy the console needs credentials: without, it refuses
    // to start.
    let log = artifacts("console-logs").join(format!("{}-nocreds.log", db.schema));
    let status = console_cmd(&db, &format!("127.0.0.1:{}", free_port()), &log)
        .args(["--base-path", "/ops/outbox"])
        .status()
        .expect("console");
    assert!(!status.success());
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("refusing to serve the console under --base-path without credentials")
    );
    let password = format!("pw-{}", Uuid::new_v4().simple());
    let console = Console::start(&db, |c| {
        c.args(["--base-path", "/ops/outbox"])
            .env("OUTBOX_CONSOLE_USER", "ops")
            .env("OUTBOX_CONSOLE_PASSWORD", &password);
    })
    .await;
    let browser = Browser::start().await;
    // The bare prefix redirects to the overview; links stay under it.
    // (Credentials in the URL: chromium sends them to the whole origin.)
    let signed_in = console
        .url
        .replace("http://", &format!("http://ops:{password}@"));
    browser.goto(&format!("{signed_in}/ops/outbox")).await;
    assert_eq!(browser.text("h1").await, "Overview");
    browser
        .click("header nav a[href='/ops/outbox/dead-letters']")
        .await;
    assert_eq!(browser.text("#matching-count").await, "3");
    // The embedded stylesheet loads from under the prefix too.
    let styled: serde_json::Value = browser
        .client
        .execute(
            "return getComputedStyle(document.querySelector('header')).display",
            vec![],
        )
        .await
        .expect("style");
    assert_eq!(styled, "flex", "console.css applied");
    browser.screenshot("base-path-dead-letters").await;
    // An action round trip under the prefix (the CSRF cookie's path).
    browser.click(&format!("input[value='{}']", ids[0])).await;
    browser.click("#replay-selected").await;
    browser.confirm_action(1, None).await;
    assert_eq!(db.count("outbox_dead_letters").await, 2);
    assert_eq!(db.count("outbox").await, 1);
    let url = browser.client.current_url().await.expect("url");
    assert_eq!(url.path(), "/ops/outbox/dead-letters/act");
    // Nothing is served outside the prefix.
    browser.goto(&format!("{signed_in}/dead-letters")).await;
    assert_eq!(browser.text("#error-title").await, "Not found");
    browser.close().await;
    drop(console);
    db.cleanup().await;
}

#[tokio::test]
async fn console_overview_shows_the_write_ahead_log_slot_and_its_reader() {
    let db = TestDb::producer_wal("console_wal").await;
    let broker = TestBroker::new("console_wal", FieldTable::default()).await;
    let ob = db.outbox(outbox::Capture::Wal).await;
    let mut tx = db.pool.begin().await.unwrap();
    ob.enqueue(
        &mut *tx,
        outbox::NewEvent::new("order", "o-1", "OrderPlaced", &serde_json::json!({})).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let console = Console::start(&db, |_| {}).await;
    let overview = || async { http_get(&format!("{}/", console.url), None).await };
    let (status, page) = overview().await;
    assert_eq!(status, 200);
    assert!(page.contains("Write-ahead log lag"), "{page}");
    assert!(page.contains(&format!("slot {}", db.slot())), "{page}");
    assert!(page.contains("NO READER"), "nobody reads the slot yet");
    // A relay reading the slot: the card names it (the page refreshes its
    // figures every 200 ms here).
    let relay = start_relay_with(
        &db,
        &broker,
        &[
            ("OUTBOX_CAPTURE", "wal"),
            ("OUTBOX_RELAY_NAME", "wal-reader"),
        ],
    );
    wait_until(
        Duration::from_secs(60),
        "the reader on the overview",
        || async {
            overview()
                .await
                .1
                .contains("read by outbox-relay wal-reader")
        },
    )
    .await;
    drop(relay);
    drop(console);
    db.cleanup().await;
    broker.cleanup().await;
}
