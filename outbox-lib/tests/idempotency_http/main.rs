//! Idempotency keys over HTTP: a real axum server on loopback, a plain
//! HTTP/1.1 client over TCP, and the real PostgreSQL. This file is the
//! server, its handlers and the client; the scenarios are `keys.rs` (one
//! execution per key: concurrency, failures, expiry, optional keys) and
//! `rejections.rs` (waits past their bound, the pool under duplicates,
//! handlers that do not finish, requests their extractors refuse).
#![cfg(feature = "axum")]

mod keys;
mod rejections;

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
use e2e::{TestDb, database_url};
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
    db: TestDb,
    pool: PgPool,
    schema: String,
    addr: SocketAddr,
    app: App,
    errors: Errors,
}

async fn start(prefix: &str, config: IdempotencyConfig, hold: Duration) -> Harness {
    let db = TestDb::producer(prefix).await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
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
        db,
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
        self.db.count(table).await
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
        self.db.cleanup().await;
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
