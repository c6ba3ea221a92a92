//! `outbox-relay console`: the operator console, a web UI over the
//! outbox (Overview, Dead letters, Failures, Blocked aggregates, Outbox)
//! and the consumers' end (Consumers, Reconcile). Pages are
//! rendered on the server; the stylesheet and one small script are
//! embedded in the binary, so nothing is fetched from elsewhere.
//!
//! Cheap on large tables: the overview's counts come from a background
//! refresher (estimates and index probes, every few seconds; the Failures
//! page's exact grouping, which does read every dead letter, less often
//! on a big table: see `failures.rs`), the lists
//! page through indexes, and no page scans the outbox or the dead letters.
//! Secure by default: see `security.rs`.

mod amqp;
mod blocked;
mod consumers;
mod dead_letters;
mod dlq;
mod failures;
mod form;
mod layout;
mod overview;
mod reconcile;
mod republish;
mod security;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use crate::admin::{self, BacklogByType, Gauges, MinuteRate, RelayLeases};
use anyhow::{Context, Result, bail};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use outbox::Ident;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub(crate) use consumers::ConsumerOptions;
pub(crate) use security::Credentials;

/// How the console is served (`outbox-relay console`'s flags).
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Where to listen.
    pub(crate) listen: SocketAddr,
    /// Path prefix of every page (`""` or `/something`), for a reverse
    /// proxy that forwards `/something/...` unchanged.
    pub(crate) base_path: String,
    /// Pages only: every action is refused.
    pub(crate) read_only: bool,
    /// Who may use it; required on a non-loopback address.
    pub(crate) credentials: Option<Credentials>,
    /// Consumers' dedup retention window (replays of older events warn).
    pub(crate) retention: Duration,
    /// How often the overview's figures are read again.
    pub(crate) refresh: Duration,
    /// The database URL: shown without its password, and scrubbed from
    /// every error the console shows or logs.
    pub(crate) database_url: String,
    /// The consumer pages: broker, queues, inbox.
    pub(crate) consumers: ConsumerOptions,
}

/// What error pages and messages need without a handle on the console:
/// the base path (their link home) and the URL to scrub from errors. Set
/// once by [`serve`]; one console per process.
struct Process {
    base_path: String,
    database_url: String,
    amqp_url: String,
}

static PROCESS: OnceLock<Process> = OnceLock::new();

/// The console's home page, for links on error pages.
pub(crate) fn home() -> String {
    PROCESS
        .get()
        .map_or("/".to_owned(), |p| format!("{}/", p.base_path))
}

/// `text` without the database URL's password (nor those of the URLs in
/// the environment).
pub(crate) fn scrub(text: &str) -> String {
    let text = crate::secrets::scrub_secrets(text);
    match PROCESS.get() {
        Some(p) => {
            outbox::redact::scrub(&outbox::redact::scrub(&text, &p.database_url), &p.amqp_url)
        }
        None => text,
    }
}

/// What every handler shares.
pub(crate) struct Console {
    pub(crate) pool: PgPool,
    pub(crate) schema: Ident,
    pub(crate) options: Options,
    /// The overview's figures, read by the refresher.
    pub(crate) snapshot: RwLock<Arc<Snapshot>>,
    /// Signs the CSRF cookies.
    pub(crate) csrf_key: security::CsrfKey,
    /// The consumer pages' broker connection, rates and reconciliations.
    pub(crate) consumers: consumers::State,
}

type Shared = Arc<Console>;

/// The overview's figures at one instant.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub(crate) taken_at: DateTime<Utc>,
    pub(crate) gauges: Gauges,
    pub(crate) relays: Vec<RelayLeases>,
    pub(crate) unleased: i64,
    pub(crate) rates: Vec<MinuteRate>,
    pub(crate) by_type: BacklogByType,
    /// The write-ahead-log capture's slot, when it is set up.
    pub(crate) wal: Option<admin::WalSlot>,
    /// Dead letters grouped by failure (the Failures page).
    pub(crate) failures: failures::Grouped,
    /// What holds the xmin horizon back (a banner on the Overview).
    pub(crate) horizon: admin::Horizon,
}

impl Console {
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// `path` under the base path.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.options.base_path)
    }
}

async fn read_snapshot(
    pool: &PgPool,
    schema: &Ident,
    previous: Option<&Snapshot>,
) -> crate::admin::Result<Snapshot> {
    let gauges = admin::gauges(pool, schema).await?;
    let (relays, unleased) = admin::relays(pool, schema).await?;
    let rates = admin::publish_rates(pool, schema, 60).await?;
    let by_type = admin::backlog_by_type(pool, schema).await?;
    let wal = admin::wal_slot(pool, schema).await?;
    let failures = failures::refreshed(pool, schema, previous.map(|p| &p.failures)).await?;
    let horizon = admin::horizon(pool, schema).await?;
    Ok(Snapshot {
        horizon,
        wal,
        failures,
        taken_at: Utc::now(),
        gauges,
        relays,
        unleased,
        rates,
        by_type,
    })
}

/// Checks the options, reads the first snapshot and serves until
/// `shutdown` is cancelled.
pub(crate) async fn serve(
    pool: PgPool,
    schema: Ident,
    options: Options,
    shutdown: CancellationToken,
) -> Result<()> {
    if !options.base_path.is_empty() && !valid_base_path(&options.base_path) {
        bail!(
            "--base-path must start with '/', not end with '/', and hold only letters, digits and -._/ (got {:?})",
            options.base_path
        );
    }
    security::check_bind(&options)?;
    let _ = PROCESS.set(Process {
        base_path: options.base_path.clone(),
        database_url: options.database_url.clone(),
        amqp_url: options
            .consumers
            .amqp_url
            .as_ref()
            .map_or(String::new(), |u| u.expose().to_owned()),
    });
    outbox::check_migrated(&pool, schema.as_str())
        .await
        .context("the console needs the outbox tables")?;
    let first = read_snapshot(&pool, &schema, None)
        .await
        .context("reading the outbox")?;
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("cannot listen on {}", options.listen))?;
    let local = listener.local_addr()?;
    let console = Arc::new(Console {
        pool,
        schema,
        consumers: consumers::State::new(&options.consumers),
        options,
        snapshot: RwLock::new(Arc::new(first)),
        csrf_key: security::CsrfKey::random(),
    });
    tokio::spawn(refresh(console.clone(), shutdown.clone()));
    tokio::spawn(consumers::refresh_rates(console.clone(), shutdown.clone()));
    let app = router(console.clone());
    tracing::info!(
        addr = %local,
        url = %format!("http://{local}{}/", console.options.base_path),
        read_only = console.options.read_only,
        auth = console.options.credentials.as_ref().map_or("none (loopback only)", Credentials::kind),
        "console listening"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await
    .context("console server failed")
}

fn valid_base_path(p: &str) -> bool {
    p.starts_with('/')
        && !p.starts_with("//")
        && !p.ends_with('/')
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._/".contains(c))
}

/// Reads the overview's figures every `refresh`; a failed read keeps the
/// previous snapshot (its age is on the page) and is logged.
async fn refresh(console: Shared, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(console.options.refresh) => {}
        }
        let previous = console.snapshot();
        match read_snapshot(&console.pool, &console.schema, Some(&previous)).await {
            Ok(s) => {
                *console.snapshot.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(s);
            }
            Err(e) => {
                let error = scrub(&e.to_string());
                tracing::warn!(%error, "console: could not refresh the overview");
            }
        }
    }
}

fn router(console: Shared) -> Router {
    let base = console.options.base_path.clone();
    let at = |p: &str| format!("{base}{p}");
    let mut app = Router::new()
        .route(&at("/"), get(overview::overview))
        .route(&at("/outbox"), get(overview::outbox))
        .route(&at("/dead-letters"), get(dead_letters::list))
        .route(&at("/dead-letters/{id}"), get(dead_letters::detail))
        .route(&at("/dead-letters/confirm"), post(dead_letters::confirm))
        .route(&at("/dead-letters/act"), post(dead_letters::act))
        .route(&at("/failures"), get(failures::groups))
        .route(&at("/blocked"), get(blocked::list))
        .route(&at("/blocked/act"), post(blocked::act))
        .route(&at("/consumers"), get(consumers::overview))
        .route(&at("/consumers/dlq"), get(dlq::list))
        .route(&at("/consumers/dlq/confirm"), post(dlq::confirm))
        .route(&at("/consumers/dlq/act"), post(dlq::act))
        .route(&at("/reconcile"), get(reconcile::show))
        .route(&at("/reconcile/confirm"), post(republish::confirm))
        .route(&at("/reconcile/act"), post(republish::act))
        .route(&at("/assets/console.css"), get(layout::css))
        .route(&at("/assets/console.js"), get(layout::js));
    if !base.is_empty() {
        let to = at("/");
        app = app.route(&base, get(move || async move { Redirect::to(&to) }));
    }
    app.fallback(layout::not_found)
        .layer(middleware::from_fn_with_state(
            console.clone(),
            security::csrf_cookie,
        ))
        .layer(middleware::from_fn_with_state(
            console.clone(),
            security::authenticate,
        ))
        .layer(middleware::from_fn(headers))
        .with_state(console)
}

/// Security headers on every response, and the server's own time for the
/// request (`Server-Timing: app;dur=<ms>`; the benchmark reads it).
async fn headers(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    let fixed = [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // Not no-referrer: with it, browsers send `Origin: null` on form POSTs,
        // which the cross-origin check must refuse.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in fixed {
        h.insert(name, HeaderValue::from_static(value));
    }
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    if let Ok(v) = HeaderValue::from_str(&format!("app;dur={ms:.2}")) {
        h.insert(HeaderName::from_static("server-timing"), v);
    }
    res
}

/// A page's error: logged, shown as a one-line message (never a URL or a
/// password: database errors name tables and constraints, not connections).
pub(crate) struct PageError(anyhow::Error);

impl<E: Into<anyhow::Error>> From<E> for PageError {
    fn from(e: E) -> Self {
        PageError(e.into())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        // Operator actions that found more than was confirmed: say so.
        if let Some(e @ crate::admin::Error::SelectionGrew { .. }) = self.0.downcast_ref() {
            return layout::error_page(
                axum::http::StatusCode::CONFLICT,
                "Nothing was changed",
                &e.to_string(),
            );
        }
        let line = scrub(&format!("{:#}", self.0));
        tracing::warn!(error = %line, "console: request failed");
        layout::error_page(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "Something went wrong",
            &line,
        )
    }
}

pub(crate) type PageResult = std::result::Result<Response, PageError>;

/// Keeps the shared state type usable in handlers' signatures.
pub(crate) type ConsoleState = State<Shared>;
