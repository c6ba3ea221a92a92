//! Idempotency keys over HTTP: a real axum server on loopback, a plain
//! HTTP/1.1 client over TCP, and the real PostgreSQL.
#![cfg(feature = "axum")]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRef, FromRequest, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use common::*;
use outbox::idempotency::{Idempotency, IdempotencyConfig, Idempotent, IdempotentRoute};
use outbox::{NewEvent, Outbox, OutboxConfig, Wakeup};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::instrument::WithSubscriber;

#[derive(Clone)]
struct App {
    route: IdempotentRoute,
    optional: IdempotentRoute,
    outbox: Outbox,
    schema: String,
    executions: Arc<AtomicUsize>,
    /// How long the handler holds its transaction open after writing.
    hold: Duration,
    fail_next: Arc<AtomicBool>,
    hang_next: Arc<AtomicBool>,
    hung_pid: Arc<Mutex<Option<i32>>>,
}

impl FromRef<App> for IdempotentRoute {
    fn from_ref(app: &App) -> Self {
        app.route.clone()
    }
}

#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    qty: i32,
}

async fn create_order(State(app): State<App>, mut req: Idempotent) -> Response {
    app.executions.fetch_add(1, Ordering::SeqCst);
    let order: Order = match req.json() {
        Ok(order) => order,
        Err(bad) => return bad,
    };
    if order.qty <= 0 {
        // A deliberate business rejection: recorded and replayed.
        let rejection = (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "qty must be positive"})),
        );
        return req.finish(rejection).await;
    }
    let id = uuid::Uuid::now_v7().to_string();
    let written = write_order(&app, req.conn(), &id, &order).await;
    if written.is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    if app.fail_next.swap(false, Ordering::SeqCst) {
        return req.finish(StatusCode::INTERNAL_SERVER_ERROR).await;
    }
    if app.hang_next.swap(false, Ordering::SeqCst) {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(req.conn())
            .await
            .unwrap();
        *app.hung_pid.lock().unwrap() = Some(pid);
        // The process "dies" here: the test terminates this session.
        std::future::pending::<()>().await;
    }
    if !app.hold.is_zero() {
        // Keeps the claim open so that concurrent requests pile up on it.
        tokio::time::sleep(app.hold).await;
    }
    let body = json!({"id": id, "sku": order.sku, "qty": order.qty});
    match order.sku.as_str() {
        "big" => req.finish((StatusCode::CREATED, "x".repeat(4096))).await,
        "stream" => {
            let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from("{}"))]);
            req.finish((StatusCode::CREATED, Body::from_stream(chunks)))
                .await
        }
        _ => {
            let headers = [
                (header::LOCATION, format!("/orders/{id}")),
                (header::HeaderName::from_static("x-unrecorded"), id.clone()),
            ];
            req.finish((StatusCode::CREATED, headers, Json(body))).await
        }
    }
}

/// Inserts an order and enqueues its event on `conn`.
async fn write_order(
    app: &App,
    conn: &mut PgConnection,
    id: &str,
    order: &Order,
) -> Result<(), outbox::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".orders (id, sku, qty) VALUES ($1, $2, $3)",
        app.schema
    )))
    .bind(id)
    .bind(&order.sku)
    .bind(order.qty)
    .execute(&mut *conn)
    .await?;
    let event = NewEvent::new(
        "order",
        id,
        "OrderPlaced",
        &json!({"sku": order.sku, "qty": order.qty}),
    )?;
    app.outbox.enqueue(conn, event).await?;
    Ok(())
}

#[derive(serde::Deserialize)]
struct Placement {
    priority: u8,
}

/// The tenant named by the `x-tenant` header: a custom extractor whose
/// rejection is a 403.
struct Tenant(String);

impl<S: Send + Sync> FromRequest<S> for Tenant {
    type Rejection = (StatusCode, &'static str);

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        match req.headers().get("x-tenant").map(|v| v.to_str()) {
            Some(Ok(tenant)) if !tenant.is_empty() => Ok(Tenant(tenant.to_owned())),
            _ => Err((StatusCode::FORBIDDEN, "unknown tenant")),
        }
    }
}

/// `POST /shops/{shop}/orders?priority=`: `Path` before the claim; `Query`,
/// the custom `Tenant` and `Json` on the buffered request after it.
async fn place_order(
    State(app): State<App>,
    Path(shop): Path<u32>,
    req: Idempotent,
) -> Result<Response, Response> {
    place(app, shop, req).await
}

/// `place_order` with `Path` extracted after the claim, too.
async fn place_order_late(State(app): State<App>, req: Idempotent) -> Result<Response, Response> {
    let Path(shop): Path<u32> = req.extract().await?;
    place(app, shop, req).await
}

async fn place(app: App, shop: u32, mut req: Idempotent) -> Result<Response, Response> {
    let Query(placement): Query<Placement> = req.extract().await?;
    let Tenant(tenant) = req.extract().await?;
    let Json(order): Json<Order> = req.extract().await?;
    app.executions.fetch_add(1, Ordering::SeqCst);
    let id = uuid::Uuid::now_v7().to_string();
    if write_order(&app, req.conn(), &id, &order).await.is_err() {
        return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let body = json!({"id": id, "shop": shop, "tenant": tenant, "priority": placement.priority});
    Ok(req.finish((StatusCode::CREATED, Json(body))).await)
}

/// A handler that writes, then returns without `finish` the status named
/// by the `x-answer` header (201 by default): its transaction rolls back,
/// so a 201 would be a lie.
async fn unfinished(State(app): State<App>, mut req: Idempotent) -> Response {
    app.executions.fetch_add(1, Ordering::SeqCst);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".orders (id, sku, qty) VALUES (gen_random_uuid()::text, 'lost', 1)",
        app.schema
    )))
    .execute(req.conn())
    .await
    .unwrap();
    let status = match req.parts().headers.get("x-answer") {
        Some(v) => StatusCode::from_bytes(v.as_bytes()).unwrap(),
        None => StatusCode::CREATED,
    };
    (status, "made").into_response()
}

/// An optional route keyed by a JSON body field, driven by hand.
async fn create_note(State(app): State<App>, request: Request) -> Response {
    let mut req = match app.optional.begin(request).await {
        Ok(req) => req,
        Err(answer) => return answer,
    };
    app.executions.fetch_add(1, Ordering::SeqCst);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".orders (id, sku, qty) VALUES (gen_random_uuid()::text, 'note', 1)",
        app.schema
    )))
    .execute(req.conn())
    .await
    .unwrap();
    req.finish((StatusCode::CREATED, "noted")).await
}

/// The ERROR events logged while the test's server handles its requests:
/// a `tracing` subscriber of the test's own, set around each request.
#[derive(Debug, Clone, Default)]
struct Errors(Arc<Mutex<Vec<String>>>);

impl Errors {
    fn logged(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

impl tracing::Subscriber for Errors {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() == tracing::Level::ERROR
    }

    fn event(&self, event: &tracing::Event<'_>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let mut line = Line(format!("{}: ", event.metadata().target()));
        event.record(&mut line);
        self.0.lock().unwrap().push(line.0);
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

struct Harness {
    pool: PgPool,
    schema: String,
    addr: SocketAddr,
    app: App,
    errors: Errors,
}

async fn start(prefix: &str, config: IdempotencyConfig, hold: Duration) -> Harness {
    let (pool, schema) = migrated(prefix).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".orders (id text PRIMARY KEY, sku text NOT NULL, qty int NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let outbox = Outbox::new(&pool, {
        let mut c = OutboxConfig::default();
        c.schema = schema.to_string();
        c.wakeup = Wakeup::PollOnly;
        c
    })
    .await
    .unwrap();
    let mut config = config;
    config.schema = schema.clone();
    let idem = Idempotency::new(&pool, config).await.unwrap();
    let app = App {
        route: IdempotentRoute::new(idem.clone())
            .max_request_bytes(4096)
            // By the path's first segment: `/shops/7/orders` and a
            // rejected `/shops/seven/orders` share their keys.
            .scope(|parts| {
                let first = parts.uri.path().split('/').nth(1).unwrap_or_default();
                format!("{} /{first}", parts.method)
            })
            .outbox(outbox.clone()),
        optional: IdempotentRoute::new(idem)
            .optional()
            .key_from_json_field("idempotency_key")
            .problem_type_base("https://api.example.test/problems#"),
        outbox,
        schema: schema.clone(),
        executions: Arc::default(),
        hold,
        fail_next: Arc::default(),
        hang_next: Arc::default(),
        hung_pid: Arc::default(),
    };
    let errors = Errors::default();
    let logged = tracing::Dispatch::new(errors.clone());
    let router = Router::new()
        .route("/orders", post(create_order))
        .route("/notes", post(create_note))
        .route("/unfinished", post(unfinished))
        .route("/shops/{shop}/orders", post(place_order))
        .route("/late/shops/{shop}/orders", post(place_order_late))
        .route(
            "/small/shops/{shop}/orders",
            post(place_order).layer(DefaultBodyLimit::max(64)),
        )
        .route_layer(axum::middleware::from_fn(
            outbox::idempotency::require_finish,
        ))
        .route("/unguarded", post(create_order))
        .with_state(app.clone())
        .layer(axum::middleware::from_fn(
            move |request: Request, next: axum::middleware::Next| {
                next.run(request).with_subscriber(logged.clone())
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Harness {
        pool,
        schema,
        addr,
        app,
        errors,
    }
}

/// [`start`] with the default settings and no hold.
async fn start_default(prefix: &str) -> Harness {
    start(prefix, IdempotencyConfig::default(), Duration::ZERO).await
}

impl Harness {
    async fn post(&self, path: &str, key: Option<&str>, body: &str) -> Reply {
        let mut headers = vec![];
        if let Some(key) = key {
            headers.push(("Idempotency-Key", key));
        }
        send(self.addr, path, &headers, body).await
    }

    async fn count(&self, table: &str) -> i64 {
        count(&self.pool, &self.schema, table).await
    }

    fn executions(&self) -> usize {
        self.app.executions.load(Ordering::SeqCst)
    }

    /// A placement (`PLACE` and its variants) under `key`, for tenant `t-1`.
    async fn place(&self, uri: &str, key: &str, body: &str) -> Reply {
        let headers = [("Idempotency-Key", key), ("x-tenant", "t-1")];
        send(self.addr, uri, &headers, body).await
    }

    async fn rows(&self) -> Rows {
        Rows {
            keys: self.count("idempotency_keys").await,
            orders: self.count("orders").await,
            events: self.count("outbox").await,
        }
    }

    /// `reply` is a rejection answered before the work: its own `status`
    /// (not a 500), not replayed, nothing recorded or written since
    /// `before`, no ERROR logged.
    async fn assert_rejected(&self, reply: &Reply, status: u16, before: &Rows) {
        assert_eq!(reply.status, status, "{reply:?}");
        assert!(!reply.replayed());
        assert_eq!(&self.rows().await, before, "nothing recorded or written");
        assert_eq!(self.errors.logged(), Vec::<String>::new(), "no ERROR");
    }

    /// The corrected request under `key` (a rejected one used it before)
    /// executes once: one more recorded key, order and event; its retry is
    /// replayed.
    async fn assert_corrected_runs_once(&self, uri: &str, key: &str) {
        let (before, ran) = (self.rows().await, self.executions());
        let first = self.place(uri, key, ORDER).await;
        assert_eq!(first.status, 201, "{first:?}");
        assert!(!first.replayed(), "the corrected request executed");
        let retry = self.place(uri, key, ORDER).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!((retry.status, &retry.body), (201, &first.body));
        assert_eq!(self.executions(), ran + 1, "executed once");
        let after = Rows {
            keys: before.keys + 1,
            orders: before.orders + 1,
            events: before.events + 1,
        };
        assert_eq!(self.rows().await, after);
        assert_eq!(self.errors.logged(), Vec::<String>::new(), "no ERROR");
    }

    async fn finish(self) {
        drop_schema(&self.pool, &self.schema).await;
    }
}

/// Recorded keys, orders and events.
#[derive(Debug, PartialEq)]
struct Rows {
    keys: i64,
    orders: i64,
    events: i64,
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts an RFC 9457 problem document with `status` and code `slug`
    /// (`type` is `about:blank` unless the route names a base).
    fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let p = self.json();
        assert_eq!(p["code"], slug, "{p}");
        let t = p["type"].as_str().unwrap();
        assert!(
            t == "about:blank" || t == format!("https://api.example.test/problems#{slug}"),
            "{p}"
        );
        assert_eq!(p["status"], status);
        assert!(p["title"].is_string() && p["detail"].is_string(), "{p}");
    }
}

/// One HTTP/1.1 POST on a fresh connection; the server closes it after
/// answering.
async fn send(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        raw
    };
    let raw = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .expect("an answer within 30 s");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete head");
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            (n.trim().to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    let body = raw[split + 4..].to_vec();
    let reply = Reply {
        status,
        headers,
        body,
    };
    if let Some(len) = reply.header("content-length") {
        assert_eq!(
            reply.body.len(),
            len.parse::<usize>().unwrap(),
            "the whole body"
        );
    } else {
        assert_eq!(
            reply.header("transfer-encoding"),
            None,
            "bodies have a known length"
        );
    }
    reply
}

const ORDER: &str = r#"{"sku":"A-1","qty":2}"#;

/// A placement whose path, query and tenant header are all valid.
const PLACE: &str = "/shops/7/orders?priority=1";

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
    drop_schema(&h.pool, &h.schema).await;
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
    drop_schema(&h.pool, &h.schema).await;
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
    let (setup, schema) = migrated("idem_pool").await;
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
    drop_schema(&setup, &schema).await;
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
