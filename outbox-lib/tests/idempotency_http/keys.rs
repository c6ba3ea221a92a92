//! One execution per key: concurrent duplicates, a changed body, a
//! missing key, failures and business rejections, a killed request, an
//! expired key, responses too large to record, optional keys.

use super::*;

#[tokio::test]
async fn fifty_concurrent_identical_requests_execute_once() {
    let h = Arc::new(
        start(
            "http_fifty",
            IdempotencyConfig::default(),
            Duration::from_millis(300),
        )
        .await,
    );
    let requests: Vec<_> = (0..50)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.post("/orders", Some("fifty-1"), ORDER).await })
        })
        .collect();
    let mut replies = Vec::new();
    for r in requests {
        replies.push(r.await.unwrap());
    }
    assert_eq!(h.executions(), 1, "the handler ran once");
    assert_eq!(h.count("orders").await, 1, "one business row");
    assert_eq!(h.count("outbox").await, 1, "one event");
    let first = &replies[0];
    assert_eq!(first.status, 201);
    for r in &replies {
        assert_eq!(
            (r.status, &r.body),
            (first.status, &first.body),
            "the same response"
        );
        assert_eq!(r.header("location"), first.header("location"));
        assert_eq!(r.header("content-type"), Some("application/json"));
    }
    let replayed: Vec<_> = replies.iter().filter(|r| r.replayed()).collect();
    assert_eq!(replayed.len(), 49);
    // Headers off the allow-list are not replayed.
    assert!(replayed.iter().all(|r| r.header("x-unrecorded").is_none()));
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.header("x-unrecorded").is_some())
            .count(),
        1
    );
    Arc::into_inner(h).unwrap().finish().await;
}

#[tokio::test]
async fn the_same_key_with_a_different_body_gets_422_and_writes_nothing() {
    let h = start(
        "http_mismatch",
        IdempotencyConfig::default(),
        Duration::ZERO,
    )
    .await;
    assert_eq!(h.post("/orders", Some("k"), ORDER).await.status, 201);
    let other = h
        .post("/orders", Some("k"), r#"{"sku":"A-1","qty":3}"#)
        .await;
    other.assert_problem(422, "key-reused");
    assert!(!other.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.count("orders").await, 1);
    assert_eq!(h.count("outbox").await, 1);
    // The original request still replays.
    assert!(h.post("/orders", Some("k"), ORDER).await.replayed());
    h.finish().await;
}

#[tokio::test]
async fn a_missing_or_invalid_key_gets_400() {
    let h = start("http_badkey", IdempotencyConfig::default(), Duration::ZERO).await;
    h.post("/orders", None, ORDER)
        .await
        .assert_problem(400, "key-missing");
    let too_long = "k".repeat(256);
    for bad in [
        "has space",
        too_long.as_str(),
        "\"unterminated",
        "caf\u{e9}",
        "\"\"",
    ] {
        h.post("/orders", Some(bad), ORDER)
            .await
            .assert_problem(400, "key-invalid");
    }
    assert_eq!(h.executions(), 0);
    assert_eq!(h.count("orders").await, 0);
    assert_eq!(h.count("idempotency_keys").await, 0);
    // The structured-field quoted form names the same key.
    assert!(!h.post("/orders", Some("abc"), ORDER).await.replayed());
    assert!(h.post("/orders", Some("\"abc\""), ORDER).await.replayed());
    // A request body over the buffering limit is refused before anything runs.
    let huge = format!(r#"{{"sku":"{}","qty":1}}"#, "x".repeat(5000));
    h.post("/orders", Some("huge"), &huge)
        .await
        .assert_problem(413, "request-too-large");
    assert_eq!(h.executions(), 1);
    h.finish().await;
}

#[tokio::test]
async fn a_500_records_nothing_and_the_retry_executes_once() {
    let h = start("http_500", IdempotencyConfig::default(), Duration::ZERO).await;
    h.app.fail_next.store(true, Ordering::SeqCst);
    let failed = h.post("/orders", Some("k"), ORDER).await;
    assert_eq!(failed.status, 500);
    assert_eq!(h.count("orders").await, 0, "the business write rolled back");
    assert_eq!(h.count("outbox").await, 0, "so did its event");
    assert_eq!(h.count("idempotency_keys").await, 0, "nothing recorded");
    let retry = h.post("/orders", Some("k"), ORDER).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "the retry executed");
    let again = h.post("/orders", Some("k"), ORDER).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(h.executions(), 2);
    assert_eq!(h.count("orders").await, 1);
    assert_eq!(h.count("outbox").await, 1);
    h.finish().await;
}

#[tokio::test]
async fn a_4xx_business_rejection_is_recorded_and_replayed() {
    let h = start("http_4xx", IdempotencyConfig::default(), Duration::ZERO).await;
    let body = r#"{"sku":"A-1","qty":0}"#;
    let first = h.post("/orders", Some("k"), body).await;
    assert_eq!(first.status, 400);
    assert_eq!(first.json(), json!({"error": "qty must be positive"}));
    let retry = h.post("/orders", Some("k"), body).await;
    assert_eq!((retry.status, &retry.body), (400, &first.body));
    assert!(retry.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.count("orders").await, 0);
    h.finish().await;
}

#[tokio::test]
async fn a_request_killed_mid_flight_leaves_a_key_the_retry_executes_once() {
    let h = Arc::new(start("http_kill", IdempotencyConfig::default(), Duration::ZERO).await);
    h.app.hang_next.store(true, Ordering::SeqCst);
    let doomed = {
        let h = h.clone();
        tokio::spawn(async move { h.post("/orders", Some("k"), ORDER).await })
    };
    // Wait for the handler to have claimed the key and written its row.
    let start = Instant::now();
    let pid = loop {
        if let Some(pid) = *h.app.hung_pid.lock().unwrap() {
            break pid;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the handler never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // What PostgreSQL sees when the server process dies: its session ends.
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert!(killed);
    doomed.abort();
    let retry = h.post("/orders", Some("k"), ORDER).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed(), "the retry executed");
    assert!(h.post("/orders", Some("k"), ORDER).await.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.count("orders").await, 1);
    assert_eq!(h.count("outbox").await, 1);
    h.db.clone().cleanup().await;
}

#[tokio::test]
async fn an_expired_key_executes_anew() {
    let h = start("http_expired", IdempotencyConfig::default(), Duration::ZERO).await;
    let first = h.post("/orders", Some("k"), ORDER).await;
    assert_eq!(first.status, 201);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".idempotency_keys SET expires_at = now() - interval '1 second'",
        h.schema
    )))
    .execute(&h.pool)
    .await
    .unwrap();
    let again = h.post("/orders", Some("k"), ORDER).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_ne!(again.body, first.body, "a new order");
    assert_eq!(h.executions(), 2);
    assert_eq!(h.count("orders").await, 2);
    assert!(h.post("/orders", Some("k"), ORDER).await.replayed());
    h.finish().await;
}

#[tokio::test]
async fn oversized_and_streaming_responses_are_refused_and_not_recorded() {
    let h = start(
        "http_big",
        {
            let mut c = IdempotencyConfig::default();
            c.max_response_bytes = 1024;
            c
        },
        Duration::ZERO,
    )
    .await;
    for (sku, slug) in [
        ("big", "response-too-large"),
        ("stream", "streaming-response"),
    ] {
        let body = format!(r#"{{"sku":"{sku}","qty":1}}"#);
        h.post("/orders", Some(sku), &body)
            .await
            .assert_problem(500, slug);
        // Nothing committed: the retry executes again (and fails again).
        assert!(!h.post("/orders", Some(sku), &body).await.replayed());
    }
    assert_eq!(h.executions(), 4);
    assert_eq!(h.count("orders").await, 0);
    assert_eq!(h.count("outbox").await, 0);
    assert_eq!(h.count("idempotency_keys").await, 0);
    h.finish().await;
}

#[tokio::test]
async fn an_optional_route_runs_without_a_key_and_reads_it_from_the_body() {
    let h = start(
        "http_optional",
        IdempotencyConfig::default(),
        Duration::ZERO,
    )
    .await;
    for _ in 0..2 {
        assert_eq!(h.post("/notes", None, r#"{"text":"hi"}"#).await.status, 201);
    }
    let keyed = r#"{"text":"hi","idempotency_key":"note-1"}"#;
    assert!(!h.post("/notes", None, keyed).await.replayed());
    let replay = h.post("/notes", None, keyed).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, b"noted");
    let bad = h
        .post("/notes", None, r#"{"idempotency_key":"bad key"}"#)
        .await;
    bad.assert_problem(400, "key-invalid");
    // This route names its problem types; the others use about:blank.
    assert_eq!(
        bad.json()["type"],
        "https://api.example.test/problems#key-invalid"
    );
    let other = h.post("/orders", Some("bad key"), ORDER).await;
    assert_eq!(other.json()["type"], "about:blank");
    assert_eq!(h.executions(), 3);
    assert_eq!(h.count("orders").await, 3);
    h.finish().await;
}
