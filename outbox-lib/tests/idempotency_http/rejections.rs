//! A duplicate waiting past its bound, duplicates that must not take the
//! pool, handlers that do not finish, and requests their extractors
//! refuse: each answered as it should be, the key freed.

use super::*;

#[tokio::test]
async fn a_concurrent_request_past_the_wait_gets_409_with_retry_after() {
    let h = Arc::new(
        start(
            "http_409",
            {
                let mut c = IdempotencyConfig::default();
                c.wait = Duration::ZERO;
                c.retry_after = Duration::from_secs(3);
                c
            },
            Duration::from_secs(2),
        )
        .await,
    );
    let first = {
        let h = h.clone();
        tokio::spawn(async move { h.post("/orders", Some("k"), ORDER).await })
    };
    // The first request holds its claim for 2 s once its row is written.
    let start = Instant::now();
    while h.executions() == 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = h.post("/orders", Some("k"), ORDER).await;
    busy.assert_problem(409, "key-in-use");
    assert_eq!(busy.header("retry-after"), Some("3"));
    assert_eq!(first.await.unwrap().status, 201);
    assert!(h.post("/orders", Some("k"), ORDER).await.replayed());
    assert_eq!(h.executions(), 1);
    h.db.clone().cleanup().await;
}

/// The small app of the pool test: a held idempotent route and a plain
/// route that needs a connection.
#[derive(Clone)]
struct Held {
    route: IdempotentRoute,
    pool: PgPool,
    release: Arc<tokio::sync::Notify>,
    executions: Arc<AtomicUsize>,
}

impl FromRef<Held> for IdempotentRoute {
    fn from_ref(app: &Held) -> Self {
        app.route.clone()
    }
}

async fn held_order(State(app): State<Held>, mut req: Idempotent) -> Response {
    app.executions.fetch_add(1, Ordering::SeqCst);
    sqlx::query("SELECT 1").execute(req.conn()).await.unwrap();
    app.release.notified().await;
    req.finish((StatusCode::CREATED, "made")).await
}

async fn ping(State(app): State<Held>) -> StatusCode {
    match sqlx::query("SELECT 1").execute(&app.pool).await {
        Ok(_) => StatusCode::OK,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Ten concurrent copies of one request on a pool of five: the copies wait
/// for the first without holding connections, so another route still gets
/// one; once the first finishes, every copy gets its recorded response.
#[tokio::test]
async fn concurrent_duplicates_do_not_take_the_pool() {
    let db = TestDb::producer("idem_pool").await;
    let schema = db.schema.clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&database_url())
        .await
        .unwrap();
    let idem = Idempotency::new(&pool, {
        let mut c = IdempotencyConfig::default();
        c.schema = schema.to_string();
        c.wait = Duration::from_secs(60);
        c
    })
    .await
    .unwrap();
    let app = Held {
        route: IdempotentRoute::new(idem),
        pool: pool.clone(),
        release: Arc::default(),
        executions: Arc::default(),
    };
    let router = Router::new()
        .route("/orders", post(held_order))
        .route_layer(axum::middleware::from_fn(
            outbox::idempotency::require_finish,
        ))
        .route("/ping", post(ping))
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let copies: Vec<_> = (0..10)
        .map(|_| tokio::spawn(send(addr, "/orders", &[("Idempotency-Key", "k-1")], ORDER)))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Queued: waiting at the gate, or (were they to hold connections while
    // they wait) the pool exhausted.
    let queued = || app.route.waiting() == 9 || (pool.size() == 5 && pool.num_idle() == 0);
    while !(app.executions.load(Ordering::SeqCst) == 1 && queued()) {
        assert!(Instant::now() < deadline, "the copies never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first holds its claim; nine copies wait; the pool still serves.
    assert_eq!(send(addr, "/ping", &[], "{}").await.status, 200);
    app.release.notify_one();
    let mut replies = Vec::new();
    for c in copies {
        replies.push(c.await.unwrap());
    }
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(replies.iter().filter(|r| r.replayed()).count(), 9);
    assert_eq!(app.executions.load(Ordering::SeqCst), 1);
    db.cleanup().await;
}

/// A handler that returns without `finish` cannot send its response: its
/// writes rolled back, so the client gets a 500 problem and nothing is
/// recorded; the retry executes. A route without the `require_finish`
/// middleware refuses to run at all.
#[tokio::test]
async fn a_handler_that_does_not_finish_cannot_claim_success() {
    let h = start(
        "idem_unfinished",
        IdempotencyConfig::default(),
        Duration::ZERO,
    )
    .await;
    let reply = h.post("/unfinished", Some("k-u"), ORDER).await;
    reply.assert_problem(500, "handler-unfinished");
    assert_eq!(h.count("orders").await, 0, "the write rolled back");
    assert_eq!(h.count("idempotency_keys").await, 0, "nothing recorded");
    // The retry executes again (and fails the same way).
    h.post("/unfinished", Some("k-u"), ORDER)
        .await
        .assert_problem(500, "handler-unfinished");
    assert_eq!(h.executions(), 2);
    let errors = h.errors.logged();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().all(|e| e.contains("without calling finish")));
    h.post("/unguarded", Some("k-g"), ORDER)
        .await
        .assert_problem(500, "route-unguarded");
    assert_eq!(h.executions(), 2, "an unguarded route runs nothing");
    h.finish().await;
}

/// A 4xx or 5xx returned without `finish` claims no success: it is sent as
/// is, with no ERROR from the guard; the writes rolled back, nothing is
/// recorded and the retry executes again.
#[tokio::test]
async fn an_error_returned_without_finish_is_sent_as_is() {
    let h = start_default("idem_unfinished_err").await;
    for (n, answer) in ["409", "503"].into_iter().enumerate() {
        for _ in 0..2 {
            let headers = [("Idempotency-Key", answer), ("x-answer", answer)];
            let reply = send(h.addr, "/unfinished", &headers, ORDER).await;
            assert_eq!(reply.status.to_string(), answer, "{reply:?}");
            assert_eq!(reply.body, b"made");
            assert!(!reply.replayed());
        }
        assert_eq!(h.executions(), 2 * (n + 1), "every retry executed");
    }
    let nothing = Rows {
        keys: 0,
        orders: 0,
        events: 0,
    };
    assert_eq!(h.rows().await, nothing);
    assert_eq!(h.errors.logged(), Vec::<String>::new());
    h.finish().await;
}

/// The defect of issue 26: a body that is not an order got a 500
/// `handler-unfinished` (and an ERROR line) instead of its 400. With
/// `Json` after the claim: 400 not JSON, 422 wrong types; with
/// `Idempotent::json`: its 400 problem. Nothing recorded, and the key
/// serves the corrected body.
#[tokio::test]
async fn a_body_that_is_not_an_order_gets_its_own_4xx_and_frees_the_key() {
    let h = start_default("idem_rej_json").await;
    let none = h.rows().await;
    for (body, status) in [("not json", 400), (r#"{"sku":"A-1","qty":"two"}"#, 422)] {
        let reply = h.place(PLACE, "k", body).await;
        h.assert_rejected(&reply, status, &none).await;
    }
    h.assert_corrected_runs_once(PLACE, "k").await;

    let reply = h.post("/orders", Some("k-json"), "not json").await;
    reply.assert_problem(400, "request-body");
    h.assert_rejected(&reply, 400, &h.rows().await).await;
    h.assert_corrected_runs_once("/orders", "k-json").await;
    h.finish().await;
}

/// A path parameter that does not parse: `Path`'s 400, whether it runs
/// before `Idempotent` (nothing claimed) or through `extract` after the
/// claim (the scope is the path's first segment, so the corrected path
/// reuses the key the rejected one claimed).
#[tokio::test]
async fn a_bad_path_gets_its_own_400_and_frees_the_key() {
    let h = start_default("idem_rej_path").await;
    for (bad, good) in [
        ("/shops/seven/orders?priority=1", PLACE),
        (
            "/late/shops/seven/orders?priority=1",
            "/late/shops/7/orders?priority=1",
        ),
    ] {
        let before = h.rows().await;
        let reply = h.place(bad, "k", ORDER).await;
        h.assert_rejected(&reply, 400, &before).await;
        h.assert_corrected_runs_once(good, "k").await;
    }
    h.finish().await;
}

/// A query string that does not parse, or lacks a field: `Query`'s 400.
#[tokio::test]
async fn a_bad_query_gets_its_own_400_and_frees_the_key() {
    let h = start_default("idem_rej_query").await;
    let none = h.rows().await;
    for bad in ["/shops/7/orders?priority=high", "/shops/7/orders"] {
        let reply = h.place(bad, "k", ORDER).await;
        h.assert_rejected(&reply, 400, &none).await;
    }
    h.assert_corrected_runs_once(PLACE, "k").await;
    h.finish().await;
}

/// A custom extractor's rejection (`Tenant`: 403 without `x-tenant`) is
/// sent as is.
#[tokio::test]
async fn a_custom_extractors_rejection_is_sent_as_is_and_frees_the_key() {
    let h = start_default("idem_rej_custom").await;
    let none = h.rows().await;
    let reply = send(h.addr, PLACE, &[("Idempotency-Key", "k")], ORDER).await;
    h.assert_rejected(&reply, 403, &none).await;
    assert_eq!(reply.body, b"unknown tenant");
    h.assert_corrected_runs_once(PLACE, "k").await;
    h.finish().await;
}

/// A body over the route's buffering limit gets the extractor's 413 before
/// anything is claimed; one under it but over the route's
/// `DefaultBodyLimit` gets `Json`'s 413 after the claim. Either way the key
/// serves the corrected request.
#[tokio::test]
async fn an_oversized_body_gets_413_and_frees_the_key() {
    let h = start_default("idem_rej_size").await;
    let small = "/small/shops/7/orders?priority=1";
    let padded = |n| format!(r#"{{"sku":"A-1","qty":2,"note":"{}"}}"#, "x".repeat(n));
    for (uri, body) in [(PLACE, padded(5000)), (small, padded(100))] {
        let before = h.rows().await;
        let reply = h.place(uri, "k", &body).await;
        h.assert_rejected(&reply, 413, &before).await;
        h.assert_corrected_runs_once(uri, "k").await;
    }
    h.finish().await;
}
