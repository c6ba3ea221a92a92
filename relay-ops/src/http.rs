//! `/metrics`, `/healthz` and `/readyz`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use futures_util::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox::Ident;
use outbox_relay::{Fleet, Health, TenantHealth};
use sqlx::PgPool;

/// Serves the three endpoints on `addr` in the background, and keeps the
/// backlog gauges fresh; returns once listening.
pub(crate) async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    pool: PgPool,
    schema: Ident,
) -> Result<()> {
    let handle = install_recorder()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let app = router(handle, health.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tokio::spawn(refresh_readiness(health));
    tokio::spawn(refresh_gauges(pool, schema));
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    Ok(())
}

/// A fleet's endpoints: as [`serve`]'s, the backlog gauges summed over the
/// tenants (the same names), how many tenants are in each state, and series
/// of their own (`outbox_relay_tenant_*{database, schema}`) for the worst
/// `worst` tenants only: a thousand tenants do not make a thousand series.
pub(crate) async fn serve_fleet(
    addr: SocketAddr,
    fleet: Fleet,
    pools: Vec<PgPool>,
    worst: usize,
) -> Result<()> {
    let handle = install_recorder()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let tenants = Arc::new(RwLock::new(String::new()));
    let app = fleet_router(handle, fleet.health(), tenants.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tokio::spawn(refresh_readiness(fleet.health()));
    tokio::spawn(refresh_tenants(fleet, pools, worst, tenants));
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    Ok(())
}

/// The process's Prometheus recorder, with the buckets of every histogram.
fn install_recorder() -> Result<PrometheusHandle> {
    PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 50.0,
            100.0, 250.0, 500.0, 1000.0,
        ])
        .context("metrics buckets")?
        .install_recorder()
        .context("installing the metrics recorder")
}

/// [`router`]'s, with the worst tenants' series (`tenants`, rendered by
/// [`refresh_tenants`]) after the recorder's.
fn fleet_router(
    handle: PrometheusHandle,
    health: Arc<Health>,
    tenants: Arc<RwLock<String>>,
) -> Router {
    let metrics = move || {
        let mut text = handle.render();
        text.push_str(&tenants.read().unwrap_or_else(|p| p.into_inner()));
        std::future::ready(text)
    };
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || std::future::ready(readiness(&health))),
        )
}

fn router(handle: PrometheusHandle, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || std::future::ready(readiness(&health))),
        )
}

/// `/readyz`: ready or not, which broker node is in use (or was last),
/// never a URL, and what keeps the relay from being ready.
fn readiness(health: &Health) -> (StatusCode, String) {
    let node = health.broker_node().unwrap_or_else(|| "none".to_owned());
    let mut body = format!(
        "{}\nbroker node: {node}\n",
        if health.is_ready() {
            "ready"
        } else {
            "not ready"
        }
    );
    if !health.broker_connected() {
        body.push_str("broker: not connected; reconnecting\n");
    }
    if let Some(reason) = health.broker_blocked() {
        body.push_str(&format!(
            "broker: blocked by a resource alarm ({reason}); publishing paused, no attempt counted, until the broker lifts it\n"
        ));
    }
    if !health.database_ok() {
        body.push_str("database: not answering or failing; retrying on fresh connections\n");
    }
    let status = if health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body)
}

/// The readiness gauges, every second: atomics only, so a database that
/// stopped answering cannot hold them at their last value.
async fn refresh_readiness(health: Arc<Health>) {
    loop {
        metrics::gauge!("outbox_relay_ready").set(f64::from(u8::from(health.is_ready())));
        metrics::gauge!("outbox_relay_broker_blocked")
            .set(f64::from(u8::from(health.broker_blocked().is_some())));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Backlog gauges, refreshed off the hot path, every 10 s for ever; a
/// refresh the database does not answer within 10 s is skipped.
async fn refresh_gauges(pool: PgPool, schema: Ident) {
    let mut reported_slot = false;
    loop {
        let bound = Duration::from_secs(10);
        // Cheap on any outbox size: estimates and index probes only.
        if let Ok(Ok(g)) = tokio::time::timeout(bound, crate::admin::gauges(&pool, &schema)).await {
            metrics::gauge!("outbox_relay_backlog").set(g.backlog as f64);
            metrics::gauge!("outbox_relay_oldest_pending_seconds").set(g.oldest_due_age_s);
            metrics::gauge!("outbox_relay_dead_letters").set(g.dead_letters as f64);
            metrics::gauge!("outbox_relay_blocked_aggregates").set(g.blocked_aggregates as f64);
        }
        if let Ok(Ok(h)) = tokio::time::timeout(bound, crate::admin::horizon(&pool, &schema)).await
        {
            horizon_gauges(&h);
        }
        match tokio::time::timeout(bound, crate::admin::wal_slot(&pool, &schema)).await {
            Ok(Ok(Some(slot))) => {
                wal_slot_gauges(&slot);
                reported_slot = true;
            }
            // Reported before, gone now (dropped, or its record
            // deleted): no stale figures for the alerts to fire on.
            Ok(Ok(None)) if reported_slot => wal_slot_gone(),
            _ => {}
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}

/// What holds the xmin horizon back, as gauges: how old (seconds, and
/// transactions), and the outbox's dead rows and size.
fn horizon_gauges(h: &crate::admin::Horizon) {
    let oldest = h.oldest.as_ref();
    metrics::gauge!("outbox_relay_horizon_age_seconds")
        .set(oldest.and_then(|o| o.age_s).unwrap_or(0.0));
    metrics::gauge!("outbox_relay_horizon_age_xids").set(oldest.map_or(0.0, |o| o.age_xids as f64));
    metrics::gauge!("outbox_relay_outbox_dead_rows").set(h.outbox_dead_rows as f64);
    metrics::gauge!("outbox_relay_outbox_bytes").set(h.outbox_bytes as f64);
}

/// The schema's replication slot as gauges (WAL capture set up): what it
/// keeps on disk, how much more it may keep, and its `wal_status` as one
/// series per status, 1 for the current one.
fn wal_slot_gauges(slot: &crate::admin::WalSlot) {
    if let Some(lag) = slot.lag_bytes {
        metrics::gauge!("outbox_relay_wal_slot_lag_bytes").set(lag as f64);
    }
    if let Some(safe) = slot.safe_wal_size {
        metrics::gauge!("outbox_relay_wal_slot_safe_bytes").set(safe as f64);
    }
    wal_slot_status(slot.wal_status.as_deref().unwrap_or("unknown"));
}

/// The slot reported before is gone: status `unknown`, nothing kept.
fn wal_slot_gone() {
    metrics::gauge!("outbox_relay_wal_slot_lag_bytes").set(0.0);
    wal_slot_status("unknown");
}

fn wal_slot_status(now: &str) {
    for status in ["reserved", "extended", "unreserved", "lost", "unknown"] {
        metrics::gauge!("outbox_relay_wal_slot_status", "status" => status)
            .set(f64::from(u8::from(status == now)));
    }
}

/// How often a fleet's tenants' figures are read again.
const TENANTS_EVERY: Duration = Duration::from_secs(15);

/// How many tenants' figures are read at once.
const TENANTS_AT_ONCE: usize = 4;

/// One served tenant's figures, for the fleet's gauges.
struct TenantFigures {
    database: String,
    schema: String,
    published: u64,
    gauges: crate::admin::Gauges,
}

/// A fleet's gauges, every [`TENANTS_EVERY`] for ever: each served
/// tenant's backlog figures read (a few at once, each bounded), summed into
/// the single relay's gauges, and the worst `worst` rendered into
/// `block`. A tenant that cannot be read counts as failing.
async fn refresh_tenants(
    fleet: Fleet,
    pools: Vec<PgPool>,
    worst: usize,
    block: Arc<RwLock<String>>,
) {
    let names: Vec<String> = pools
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.connect_options()
                .get_database()
                .map_or_else(|| format!("database {i}"), str::to_owned)
        })
        .collect();
    loop {
        let tenants = fleet.tenants();
        if tenants.is_empty() {
            // The first census has not answered yet (or found none).
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let (mut ok, mut failing, mut not_served) = (0u32, 0u32, 0u32);
        let mut served = Vec::new();
        for t in tenants {
            match &t.health {
                TenantHealth::NotServed { .. } => not_served += 1,
                health => {
                    if matches!(health, TenantHealth::Failing { .. }) {
                        failing += 1;
                    } else {
                        ok += 1;
                    }
                    served.push(t);
                }
            }
        }
        let reads = futures_util::stream::iter(served)
            .map(|t| {
                let pool = pools.get(t.database).cloned();
                let database = names.get(t.database).cloned().unwrap_or_default();
                let failing = matches!(t.health, TenantHealth::Failing { .. });
                async move {
                    let read = async {
                        let pool = pool?;
                        let schema = Ident::new("schema", &t.schema).ok()?;
                        let read = crate::admin::gauges(&pool, &schema);
                        match tokio::time::timeout(Duration::from_secs(10), read).await {
                            Ok(Ok(gauges)) => Some(TenantFigures {
                                database,
                                schema: t.schema,
                                published: t.published,
                                gauges,
                            }),
                            _ => None,
                        }
                    };
                    (failing, read.await)
                }
            })
            .buffer_unordered(TENANTS_AT_ONCE);
        let read: Vec<(bool, Option<TenantFigures>)> = reads.collect().await;
        // A tenant whose batches go through but whose figures cannot be
        // read counts as failing too (once).
        let unread = read.iter().filter(|(f, r)| !f && r.is_none()).count() as u32;
        let mut figures: Vec<TenantFigures> = read.into_iter().filter_map(|(_, r)| r).collect();
        fleet_gauges(
            &figures,
            ok.saturating_sub(unread),
            failing + unread,
            not_served,
        );
        // The oldest pending first, then the largest backlog.
        figures.sort_by(|a, b| {
            b.gauges
                .oldest_due_age_s
                .total_cmp(&a.gauges.oldest_due_age_s)
                .then(b.gauges.backlog.cmp(&a.gauges.backlog))
                .then(a.schema.cmp(&b.schema))
        });
        figures.truncate(worst);
        *block.write().unwrap_or_else(|p| p.into_inner()) = worst_tenants(&figures);
        tokio::time::sleep(TENANTS_EVERY).await;
    }
}

/// The sums over the tenants, under the single relay's names, and the
/// tenants by state.
fn fleet_gauges(figures: &[TenantFigures], ok: u32, failing: u32, not_served: u32) {
    let sum =
        |f: fn(&crate::admin::Gauges) -> i64| figures.iter().map(|t| f(&t.gauges)).sum::<i64>();
    metrics::gauge!("outbox_relay_backlog").set(sum(|g| g.backlog) as f64);
    metrics::gauge!("outbox_relay_dead_letters").set(sum(|g| g.dead_letters) as f64);
    metrics::gauge!("outbox_relay_blocked_aggregates").set(sum(|g| g.blocked_aggregates) as f64);
    metrics::gauge!("outbox_relay_oldest_pending_seconds").set(
        figures
            .iter()
            .map(|t| t.gauges.oldest_due_age_s)
            .fold(0.0, f64::max),
    );
    for (state, n) in [("ok", ok), ("failing", failing), ("not_served", not_served)] {
        metrics::gauge!("outbox_relay_tenants", "state" => state).set(f64::from(n));
    }
}

/// The worst tenants' series, in Prometheus' text format.
fn worst_tenants(figures: &[TenantFigures]) -> String {
    type Figure = fn(&TenantFigures) -> f64;
    let families: [(&str, &str, &str, Figure); 4] = [
        (
            "outbox_relay_tenant_backlog",
            "gauge",
            "Events in the tenant's outbox (estimated above 100,000).",
            |t| t.gauges.backlog as f64,
        ),
        (
            "outbox_relay_tenant_oldest_pending_seconds",
            "gauge",
            "Age of the tenant's oldest due event.",
            |t| t.gauges.oldest_due_age_s,
        ),
        (
            "outbox_relay_tenant_dead_letters",
            "gauge",
            "Events in the tenant's dead-letter table.",
            |t| t.gauges.dead_letters as f64,
        ),
        (
            "outbox_relay_tenant_published_total",
            "counter",
            "Events of the tenant this process published.",
            |t| t.published as f64,
        ),
    ];
    let mut text = String::new();
    if figures.is_empty() {
        return text;
    }
    for (name, kind, help, figure) in families {
        let _ = writeln!(
            text,
            "# HELP {name} {help} Only for the worst tenants (--metrics-tenants).\n# TYPE {name} {kind}"
        );
        for t in figures {
            let _ = writeln!(
                text,
                "{name}{{database=\"{}\",schema=\"{}\"}} {}",
                label(&t.database),
                label(&t.schema),
                figure(t)
            );
        }
    }
    text
}

/// A label value escaped as the text format wants it.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
