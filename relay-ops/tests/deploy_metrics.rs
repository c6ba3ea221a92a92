//! The alert rules (`deploy/prometheus/alerts.yml`) and the Grafana
//! dashboard (`deploy/grafana/outbox.json`) name only metrics that a
//! running relay or consumer exports. A real `outbox-relay run` (table and
//! write-ahead-log capture, `--metrics-addr`) and an in-process consumer
//! serving its recorder on `/metrics`, as a service would, are made to
//! publish, retry, dead-letter, conflict and panic, so that the metrics
//! registered only once their event happens exist too; then every name
//! the rules and panels use must be on one of the two `/metrics` pages,
//! with no exception: the replication slot's lag and `wal_status` are the
//! relay's own gauges (`outbox_relay_wal_slot_*`), not postgres_exporter's.
//!
//! Needs the engine's `fault-injection` (a worker panic on purpose), which
//! this package's tests turn on (its dev-dependency on `outbox-relay`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::{KillOnDrop, TestBroker, TestDb, amqp_url, http_get};
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;
use metrics_exporter_prometheus::PrometheusBuilder;
use nix::sys::signal::Signal;
use outbox::{Capture, NewEvent};
use outbox_consumer::{Consumer, ConsumerConfig, Event, Handler, Outcome, TopologyConfig};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const ALERTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/prometheus/alerts.yml"
);
const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/outbox.json");

#[tokio::test]
async fn every_metric_the_alerts_and_the_dashboard_use_is_exported() {
    let referenced = referenced_metrics();
    let world = World::start().await;
    world.produce_every_condition().await;

    let deadline = Instant::now() + Duration::from_secs(90);
    let missing = loop {
        let mut exported = exported_names(&scrape(world.relay_addr).await);
        exported.extend(exported_names(&scrape(world.consumer.addr).await));
        let missing: BTreeMap<&String, &BTreeSet<String>> = referenced
            .iter()
            .filter(|(name, _)| !exported.contains(*name))
            .collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing
                .into_iter()
                .map(|(n, w)| {
                    format!(
                        "{n} (in {})",
                        w.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                })
                .collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    world.stop().await;
    assert!(
        missing.is_empty(),
        "metrics named by the alerts or the dashboard that neither the relay nor a consumer exports:\n  {}",
        missing.join("\n  ")
    );
}

/// Every metric name of the rules' expressions and the dashboard's
/// queries (histogram series by their base name), with where each is used.
fn referenced_metrics() -> BTreeMap<String, BTreeSet<String>> {
    let alerts = std::fs::read_to_string(ALERTS).expect("deploy/prometheus/alerts.yml");
    let rules = yaml_exprs(&alerts);
    assert!(
        rules.len() >= 10,
        "only {} rules in alerts.yml",
        rules.len()
    );
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(DASHBOARD).expect("deploy/grafana/outbox.json"),
    )
    .expect("the dashboard is JSON");
    let queries = dashboard_queries(&dashboard);
    assert!(
        queries.len() >= 15,
        "only {} dashboard queries",
        queries.len()
    );

    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let places = rules
        .into_iter()
        .map(|(rule, expr)| (format!("alerts.yml {rule}"), expr))
        .chain(
            queries
                .into_iter()
                .map(|(panel, expr)| (format!("outbox.json {panel:?}"), expr)),
        );
    for (place, expr) in places {
        let names = promql_metric_names(&expr);
        assert!(!names.is_empty(), "no metric found in {place}: {expr:?}");
        for name in names {
            used.entry(name).or_default().insert(place.clone());
        }
    }
    used
}

/// The `expr:` values of a Prometheus rules file, each with the name of
/// its rule (`- alert:` or `- record:`): inline, or a block scalar
/// (`expr: >-` or `expr: |`) on the more indented lines after it.
fn yaml_exprs(yaml: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    let mut rule = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let body = line.trim_start();
        let key = body.trim_start_matches("- ");
        let indent = line.len() - key.len();
        if let Some(name) = key
            .strip_prefix("alert:")
            .or_else(|| key.strip_prefix("record:"))
        {
            rule = name.trim().to_owned();
        }
        let Some(value) = key.strip_prefix("expr:").map(str::trim) else {
            continue;
        };
        let expr = if value.starts_with(['|', '>']) {
            let mut block = Vec::new();
            while let Some(next) = lines.get(i) {
                let inner = next.trim_start();
                if !inner.is_empty() && next.len() - inner.len() <= indent {
                    break;
                }
                block.push(inner);
                i += 1;
            }
            block.join(" ")
        } else if let Some(quoted) = value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
            quoted.replace("''", "'")
        } else if let Some(quoted) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
            quoted.replace("\\\"", "\"")
        } else {
            value.to_owned()
        };
        exprs.push((rule.clone(), expr));
    }
    exprs
}

/// Every panel query of the dashboard (`targets[].expr`, rows' nested
/// panels included) and the metric of each `label_values(metric, label)`
/// variable, with the panel's or variable's title.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    fn panels(list: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for panel in list.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?").to_owned();
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((title.clone(), expr.to_owned()));
                }
            }
            panels(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = var["query"]["query"]
            .as_str()
            .or(var["query"].as_str())
            .unwrap_or("");
        if let Some(args) = query.strip_prefix("label_values(") {
            let metric = args.split(',').next().unwrap_or("").trim();
            out.push((format!("variable {}", var["name"]), metric.to_owned()));
        }
    }
    out
}

/// The metric names a PromQL expression selects: identifiers that are not
/// functions or keywords, outside label matchers, strings, ranges and
/// grouping lists. Histogram series (`_bucket`, `_sum`, `_count`) by their
/// base name.
fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    // Operators, and the aggregations (followed by `by (..)` rather than
    // by their argument in `sum by (le) (x)`).
    const KEYWORDS: &str = "and or unless bool offset by without on ignoring group_left \
        group_right atan2 inf nan sum min max avg group stddev stdvar count count_values \
        bottomk topk quantile limitk limit_ratio";
    const GROUPING: &str = "by without on ignoring group_left group_right";
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Skips from an opening `open` to after its matching `close`.
    let skip = |mut i: usize, open: char, close: char| {
        let mut depth = 0;
        while i < chars.len() {
            if chars[i] == open {
                depth += 1;
            } else if chars[i] == close {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            i += 1;
        }
        i
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' => i = skip(i, '{', '}'),
            '[' => i = skip(i, '[', ']'),
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                // A number's exponent or a duration (`1e9`, `5m`).
                let after_digit =
                    start > 0 && (chars[start - 1].is_ascii_digit() || chars[start - 1] == '.');
                let mut next = i;
                while next < chars.len() && chars[next].is_whitespace() {
                    next += 1;
                }
                let call = chars.get(next) == Some(&'(');
                let lower = word.to_lowercase();
                let is = |list: &str| list.split_whitespace().any(|k| k == lower);
                if is(GROUPING) && call {
                    i = skip(next, '(', ')');
                } else if !after_digit && !call && !is(KEYWORDS) {
                    names.insert(base_name(&word).to_owned());
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// A histogram's or summary's series by the name it was recorded under.
fn base_name(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// A relay's page says it is ready and has the slot's lag and a healthy
/// `wal_status` (reserved or extended, as the alerts take it).
fn reports_ready_and_slot(page: &str) -> bool {
    let value = |series: &str| {
        page.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    value("outbox_relay_ready") == Some(1.0)
        && value("outbox_relay_wal_slot_lag_bytes").is_some_and(|lag| lag >= 0.0)
        && ["reserved", "extended"].iter().any(|status| {
            value(&format!(
                "outbox_relay_wal_slot_status{{status=\"{status}\"}}"
            )) == Some(1.0)
        })
}

/// The metric names of a Prometheus text page.
fn exported_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|n| base_name(n).to_owned())
        .collect()
}

#[test]
fn promql_names_are_the_metric_names_only() {
    let names = |e: &str| promql_metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"max without (instance, pod) (outbox_relay_oldest_pending_seconds{job=~"a|b"}) > 3e2"#
        ),
        ["outbox_relay_oldest_pending_seconds"]
    );
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (le) (rate(outbox_relay_wal_delay_seconds_bucket[5m]))) \
             or x_total unless on (job) group_left (node) y offset 15m"
        ),
        ["outbox_relay_wal_delay_seconds", "x_total", "y"]
    );
    assert_eq!(
        names(
            r#"sum(rate(a_sum[$__rate_interval])) / sum(rate(a_count[1h:5m])) or vector(0) and absent(b{c="d(e)"})"#
        ),
        ["a", "b"]
    );
    let rules = [
        "groups:",
        "  - name: g",
        "    rules:",
        "      - alert: A",
        "        expr: up == 0",
        "      - record: b:c",
        "        expr: >-",
        "          a",
        "          or b",
        "        for: 1m",
        "      - alert: C",
        "        expr: 'c{d=''e''}'",
    ]
    .join("\n");
    let pairs = |v: &[(&str, &str)]| {
        v.iter()
            .map(|(r, e)| (r.to_string(), e.to_string()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        yaml_exprs(&rules),
        pairs(&[("A", "up == 0"), ("b:c", "a or b"), ("C", "c{d='e'}")])
    );
}

/// A relay process with `/metrics`, and a consumer in this process with
/// its recorder on `/metrics`, on one test's schema, exchange and queues.
struct World {
    db: TestDb,
    broker: TestBroker,
    consumer_schema: String,
    queue: String,
    relay: KillOnDrop,
    relay_addr: SocketAddr,
    consumer: RunningConsumer,
}

impl World {
    async fn start() -> Self {
        let db = TestDb::producer_wal("deploy_metrics").await;
        let broker = TestBroker::new("deploy_metrics", FieldTable::default()).await;
        let relay_addr = free_addr();
        let relay = spawn_relay(&db, &broker, relay_addr);
        let consumer_schema = format!("{}_c", db.schema);
        let queue = format!("{}.consumer", broker.queue);
        let consumer = start_consumer(&db, &broker, &consumer_schema, &queue).await;
        e2e::wait_until(Duration::from_secs(30), "the relay to be ready", || async {
            http_get(relay_addr, "/readyz")
                .await
                .is_some_and(|(s, _)| s == 200)
        })
        .await;
        // The relay's gauges of readiness and of the schema's slot come
        // from its 10 s refresh (the first at its start): wait until it
        // reports itself ready and the slot healthy, as the alerts read it.
        e2e::wait_until(
            Duration::from_secs(30),
            "the relay's outbox_relay_ready 1 and slot gauges",
            || async {
                http_get(relay_addr, "/metrics")
                    .await
                    .is_some_and(|(s, page)| s == 200 && reports_ready_and_slot(&page))
            },
        )
        .await;
        Self {
            db,
            broker,
            consumer_schema,
            queue,
            relay,
            relay_addr,
            consumer,
        }
    }

    /// Events through both capture paths that the consumer processes,
    /// retries, rejects and conflicts on, and one that panics a relay worker
    /// (the culprit is dead-lettered).
    async fn produce_every_condition(&self) {
        for (capture, types) in [
            (
                Capture::Table,
                &[
                    "ItemAdded",
                    ITEM_RETRIED,
                    ITEM_REJECTED,
                    ITEM_CONFLICTED,
                    outbox_relay::FAULT_PANIC_EVENT_TYPE,
                ][..],
            ),
            (Capture::Wal, &["ItemAdded", "ItemAdded"][..]),
        ] {
            let outbox = self.db.outbox(capture).await;
            for (n, event_type) in types.iter().enumerate() {
                let mut tx = self.db.pool.begin().await.unwrap();
                let event =
                    NewEvent::new("item", format!("i-{n}"), *event_type, &json!({"n": n})).unwrap();
                outbox.enqueue(&mut *tx, event).await.unwrap();
                outbox.commit(tx).await.unwrap();
            }
        }
    }

    async fn stop(mut self) {
        self.consumer.stop.cancel();
        let _ = self.consumer.task.await;
        assert_eq!(
            e2e::stop_child(&mut self.relay, Signal::SIGTERM, Duration::from_secs(60)).await,
            Some(0),
            "the relay drains and exits 0 on SIGTERM"
        );
        let conn = e2e::connect().await;
        if let Ok(ch) = conn.create_channel().await {
            for q in [
                self.queue.clone(),
                format!("{}.retry", self.queue),
                format!("{}.dlq", self.queue),
            ] {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.consumer_schema
        )))
        .execute(&self.db.pool)
        .await;
        self.broker.cleanup().await;
        self.db.cleanup().await;
    }
}

/// `outbox-relay run` reading the table and the schema's slot, serving
/// `/metrics` on `addr`.
fn spawn_relay(db: &TestDb, broker: &TestBroker, addr: SocketAddr) -> KillOnDrop {
    KillOnDrop(
        e2e::relay_command(BIN, db, broker)
            .env("OUTBOX_CAPTURE", "wal")
            .env("OUTBOX_METRICS_ADDR", addr.to_string())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("outbox-relay starts"),
    )
}

/// A consumer of `queue` (bound to the test's exchange) in `schema`, with
/// this process's metrics served as a service would: a Prometheus
/// recorder and a route that renders it. Returns that route's address.
async fn start_consumer(
    db: &TestDb,
    broker: &TestBroker,
    schema: &str,
    queue: &str,
) -> RunningConsumer {
    outbox_consumer::migrate(&db.pool, schema)
        .await
        .expect("consumer migrations");
    outbox_consumer::declare_topology(
        &e2e::connect().await,
        &TopologyConfig::new(queue, &broker.exchange, "#"),
    )
    .await
    .expect("consumer topology");
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this test process");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(handle.render())),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut config = ConsumerConfig::new(amqp_url(), queue, "deploy-metrics");
    config.schema = schema.to_owned();
    config.retry_delay = Duration::from_millis(100);
    let consumer = Consumer::new(
        config,
        e2e::pool("deploy-metrics-consumer", 4).await,
        Conditions::default(),
    )
    .expect("consumer");
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(stop).await }
    });
    RunningConsumer { addr, stop, task }
}

/// A consumer running in this process, and where its metrics are served.
struct RunningConsumer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<outbox_consumer::Result<()>>,
}

const ITEM_RETRIED: &str = "ItemRetried";
const ITEM_REJECTED: &str = "ItemRejected";
const ITEM_CONFLICTED: &str = "ItemConflicted";

/// Acks everything, except: `ItemRetried` asks for a retry at its first
/// delivery, `ItemRejected` is rejected (to the DLQ), and `ItemConflicted`
/// meets a real serialization failure once (its batch runs again).
#[derive(Default)]
struct Conditions {
    conflicted: Arc<AtomicBool>,
}

impl Handler for Conditions {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        match event.event_type() {
            Some(ITEM_RETRIED) if event.retry_count() == 0 => Outcome::retry("first delivery"),
            Some(ITEM_REJECTED) => Outcome::reject("rejected on purpose"),
            Some(ITEM_CONFLICTED) if !self.conflicted.swap(true, Ordering::SeqCst) => {
                match sqlx::raw_sql(
                    "DO $$ BEGIN RAISE EXCEPTION 'a concurrent update, on purpose' \
                     USING ERRCODE = 'serialization_failure'; END $$",
                )
                .execute(conn)
                .await
                {
                    Err(e) => e.into(),
                    Ok(_) => Outcome::reject("the serialization failure was not raised"),
                }
            }
            _ => Outcome::Ack,
        }
    }
}

/// A free loopback port: bind, read it, release it.
fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], e2e::free_port()))
}

async fn scrape(addr: SocketAddr) -> String {
    match http_get(addr, "/metrics").await {
        Some((200, body)) => body,
        other => panic!("GET http://{addr}/metrics: {other:?}"),
    }
}
