//! The orders API over HTTP, served in process on loopback: a client's
//! malformed order is answered with its own 4xx (never a 500, never an
//! ERROR line) and leaves the `Idempotency-Key` free for the corrected one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::Request;
use axum::middleware::Next;
use e2e::TestDb;
use tracing::instrument::WithSubscriber;
use tracing_subscriber::layer::SubscriberExt;

/// Counts the ERROR events logged while the server handles a request.
#[derive(Debug, Clone, Default)]
struct Errors(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Status and whether it was replayed, of one `POST /orders` under `key`.
async fn post_order(addr: SocketAddr, key: &str, body: &str) -> (u16, bool) {
    let reply = e2e::post_json(addr, "/orders", key, body).await;
    (reply.status, reply.replayed)
}

#[tokio::test]
async fn a_malformed_order_gets_its_4xx_not_a_500_and_frees_the_key() {
    let db = TestDb::producer("orders_http").await;
    let state = orders::setup(&db.pool, &db.schema).await.unwrap();
    let errors = Errors::default();
    let logged = tracing::Dispatch::new(tracing_subscriber::registry().with(errors.clone()));
    let app = orders::router(state).layer(axum::middleware::from_fn(
        move |request: Request, next: Next| next.run(request).with_subscriber(logged.clone()),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    assert_eq!(post_order(addr, "k-1", "{not json").await, (400, false));
    let wrong_types = r#"{"sku":"A-1","qty":"two"}"#;
    assert_eq!(post_order(addr, "k-1", wrong_types).await, (422, false));
    assert_eq!(db.count("orders").await, 0);
    assert_eq!(db.count("idempotency_keys").await, 0, "nothing recorded");

    let order = r#"{"sku":"A-1","qty":2}"#;
    assert_eq!(post_order(addr, "k-1", order).await, (201, false));
    assert_eq!(post_order(addr, "k-1", order).await, (201, true));
    assert_eq!(db.count("orders").await, 1, "placed once");
    assert_eq!(errors.0.load(Ordering::SeqCst), 0, "no ERROR logged");
    db.cleanup().await;
}
