//! The console's page times on big tables: an outbox of 2,000,000 rows and
//! 200,000 dead letters (the sizes; `--smoke` uses 1%), served by
//! the release `outbox-relay console`. Each page is requested many times;
//! the time is the server's own (`Server-Timing`), so the figures leave
//! out this client and the loopback network.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{drop_schema, fresh_schema};

/// Sizes of the seeded tables.
pub(crate) struct Seed {
    pub(crate) outbox: i64,
    pub(crate) dead_letters: i64,
    /// Requests per page.
    pub(crate) requests: usize,
}

/// One page's server times, in ms.
pub(crate) struct PageTimes {
    pub(crate) name: String,
    pub(crate) p50: f64,
    pub(crate) p95: f64,
}

/// What the section measured.
pub(crate) struct ConsoleTimes {
    pub(crate) pages: Vec<PageTimes>,
    /// The background refresher's read of the overview's figures (gauges,
    /// relays, rates, backlog by type), p95 over `requests` reads, in ms.
    pub(crate) refresh_p95: f64,
    pub(crate) seed_secs: f64,
    /// The overview's backlog and dead-letter figures over the exact
    /// counts, before and after ANALYZE: `(phase, backlog, dead letters)`.
    pub(crate) estimates: Vec<(&'static str, f64, f64)>,
}

/// Fills `schema`: `outbox` rows (98% unordered over 8 event types, 1% of
/// them retrying; 2% ordered over 2,000 aggregates, 50 of them blocked by
/// a failing head) and `dead` dead letters (12 event types, 40 aggregate
/// types, 6 errors, dead-lettered over the last 7 days), then analyses.
async fn seed(pool: &PgPool, schema: &str, outbox: i64, dead: i64) -> Result<()> {
    let s = format!("\"{schema}\"");
    let ordered = outbox / 50;
    let statements = [
        format!(
            "INSERT INTO {s}.outbox (aggregate_type, aggregate_id, event_type, payload, attempts, last_error, available_at)
             SELECT 'order', 'o-' || (g % 100000), 'Order' || (ARRAY['Placed','Paid','Packed','Shipped','Delivered','Cancelled','Refunded','Updated'])[1 + g % 8],
                    jsonb_build_object('order', g, 'customer', 'c-' || (g % 5000), 'lines', jsonb_build_array(jsonb_build_object('sku', 'sku-' || (g % 700), 'qty', 1 + g % 3)), 'note', repeat('x', 120)),
                    CASE WHEN g % 100 = 0 THEN 1 + g % 7 ELSE 0 END,
                    CASE WHEN g % 100 = 0 THEN 'NO_ROUTE: no queue bound to the exchange' END,
                    CASE WHEN g % 100 = 0 THEN now() + interval '10 minutes' ELSE now() - (g % 3600) * interval '1 second' END
             FROM generate_series(1, {}) g",
            outbox - ordered
        ),
        format!(
            "INSERT INTO {s}.outbox (aggregate_type, aggregate_id, event_type, payload, aggregate_seq, attempts, last_error, available_at)
             SELECT 'account', 'a-' || (g % 2000), 'AccountEvent', jsonb_build_object('n', g),
                    1 + g / 2000,
                    CASE WHEN g < 50 THEN 4 ELSE 0 END,
                    CASE WHEN g < 50 THEN 'timeout waiting for the broker''s confirm' END,
                    CASE WHEN g < 50 THEN now() + interval '1 hour' ELSE now() END
             FROM generate_series(0, {}) g",
            ordered - 1
        ),
        format!(
            "INSERT INTO {s}.outbox_dead_letters
                 (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, last_error, error_history, dead_lettered_at)
             SELECT gen_random_uuid(), 'agg' || (g % 40), 'id-' || (g % 20000), 'Event' || (g % 12),
                    jsonb_build_object('n', g, 'note', repeat('y', 150)), '{{}}'::jsonb, now() - interval '8 days', 1 + g % 10,
                    (ARRAY['NO_ROUTE: no queue bound to the exchange', 'payload too large: 2000000 bytes',
                           'timeout waiting for the broker''s confirm', 'broker returned 406 PRECONDITION_FAILED',
                           'channel closed: 320 CONNECTION_FORCED', 'nacked by the broker'])[1 + g % 6]
                        || CASE WHEN g % 50000 = 7 THEN ' (rare marker zq-17)' ELSE '' END,
                    jsonb_build_array(jsonb_build_object('at', now() - interval '8 days', 'error', 'first attempt failed')),
                    now() - (g * (604800.0 / {dead})) * interval '1 second'
             FROM generate_series(1, {dead}) g"
        ),
    ];
    // Never analysed, as a freshly loaded or restored table: autovacuum
    // stays off on both until the analysed phase.
    for table in ["outbox", "outbox_dead_letters"] {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE {s}.{table} SET (autovacuum_enabled = false)"
        )))
        .execute(pool)
        .await?;
    }
    for sql in statements {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
    }
    Ok(())
}

/// The console binary beside this one, on `schema`, listening on `port`.
fn spawn_console(database_url: &str, schema: &str, port: u16) -> Result<Child> {
    Command::new(crate::relay::relay_binary()?)
        .env("DATABASE_URL", database_url)
        .env("OUTBOX_SCHEMA", schema)
        .env("RUST_LOG", "warn")
        .env_remove("OUTBOX_CONSOLE_PASSWORD")
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .args(["console", "--listen", &format!("127.0.0.1:{port}")])
        .env("OUTBOX_CONSOLE_AMQP_URL", bench_amqp_url())
        .env(
            "OUTBOX_CONSOLE_CONSUMER_QUEUE",
            format!("stock={}", consumer_queue(schema)),
        )
        .stdout(Stdio::null())
        .spawn()
        .context("starting outbox-relay console")
}

/// One HTTP/1.1 exchange: (status, headers and body as text).
async fn http(
    port: u16,
    method: &str,
    path: &str,
    cookie: &str,
    body: &str,
) -> Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut raw))
        .await
        .context("no answer within 60 s")??;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, text))
}

/// `Server-Timing: app;dur=<ms>` of a response.
fn server_ms(response: &str) -> Option<f64> {
    response
        .lines()
        .take_while(|l| !l.is_empty())
        .find_map(|l| l.strip_prefix("server-timing: app;dur="))
        .and_then(|v| v.trim().parse().ok())
}

/// The text between `start` and the next `end` after it.
fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = text.find(start)? + start.len();
    Some(&text[from..from + text[from..].find(end)?])
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(crate) async fn measure(
    pool: &PgPool,
    database_url: &str,
    seed_sizes: &Seed,
) -> Result<ConsoleTimes> {
    let schema = fresh_schema(pool, "console").await?;
    let started = Instant::now();
    seed(pool, &schema, seed_sizes.outbox, seed_sizes.dead_letters).await?;
    seed_consumer(pool, &schema, seed_sizes.outbox / 20).await?;
    let seed_secs = started.elapsed().as_secs_f64();
    let result = two_phases(pool, database_url, &schema, seed_sizes).await;
    drop_schema(pool, &schema).await?;
    delete_consumer_queues(&schema).await?;
    Ok(ConsoleTimes {
        seed_secs,
        ..result?
    })
}

/// Every page on the tables as loaded (never analysed), then again after
/// `VACUUM ANALYZE`; one console process per phase.
async fn two_phases(
    pool: &PgPool,
    database_url: &str,
    schema: &str,
    seed_sizes: &Seed,
) -> Result<ConsoleTimes> {
    let exact = (seed_sizes.outbox as f64, seed_sizes.dead_letters as f64);
    let mut all = ConsoleTimes {
        pages: Vec::new(),
        refresh_p95: 0.0,
        seed_secs: 0.0,
        estimates: Vec::new(),
    };
    for phase in ["unanalysed", "analysed"] {
        if phase == "analysed" {
            for table in ["outbox", "outbox_dead_letters"] {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "VACUUM ANALYZE \"{schema}\".{table}"
                )))
                .execute(pool)
                .await?;
            }
        }
        let t = measure_pages(pool, database_url, schema, seed_sizes.requests).await?;
        let (backlog, dead) = t.figures;
        all.estimates
            .push((phase, backlog / exact.0, dead / exact.1));
        for mut p in t.pages {
            p.name = format!("{}_{phase}", p.name);
            all.pages.push(p);
        }
        all.refresh_p95 = all.refresh_p95.max(t.refresh_p95);
    }
    Ok(all)
}

/// What one console process measured: page times, the refresher's p95,
/// and the overview's (backlog, dead letters) figures.
struct Phase {
    pages: Vec<PageTimes>,
    refresh_p95: f64,
    figures: (f64, f64),
}

async fn measure_pages(
    pool: &PgPool,
    database_url: &str,
    schema: &str,
    requests: usize,
) -> Result<Phase> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = spawn_console(database_url, schema, port)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the console did not listen within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = pages(pool, port, schema, requests).await;
    let _ = child.kill();
    let _ = child.wait();
    out
}

/// A card's figure on the overview (`id="<id>">1,234,567<`).
fn card_figure(overview: &str, id: &str) -> Option<f64> {
    between(overview, &format!("id=\"{id}\">"), "<")?
        .replace(',', "")
        .trim()
        .parse()
        .ok()
}

async fn pages(pool: &PgPool, port: u16, schema: &str, requests: usize) -> Result<Phase> {
    let (_, overview) = http(port, "GET", "/", "", "").await?;
    let figures = (
        card_figure(&overview, "backlog").context("no backlog figure")?,
        card_figure(&overview, "dead-letters").context("no dead-letter figure")?,
    );
    // The CSRF cookie and token, as a browser gets them.
    let (_, first) = http(port, "GET", "/dead-letters", "", "").await?;
    let token = between(&first, "outbox_console_csrf=", ";")
        .context("no CSRF cookie")?
        .to_owned();
    let cookie = format!("outbox_console_csrf={token}");
    let link = |page: &str, id: &str| {
        between(page, &format!("id=\"{id}\" href=\""), "\"").map(|l| l.replace("&amp;", "&"))
    };
    let next = link(&first, "next-page").context("no second page")?;
    let (_, second) = http(port, "GET", &next, &cookie, "").await?;
    let previous = link(&second, "previous-page").context("no previous page")?;
    let one: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM \"{schema}\".outbox_dead_letters ORDER BY dead_lettered_at LIMIT 1 OFFSET 5"
    )))
    .fetch_one(pool)
    .await?;
    let confirm = |filter: &str| format!("csrf={token}&action=replay&scope=matching{filter}");
    let get = |name: &'static str, path: &str| (name, "GET", path.to_owned(), String::new());
    let mut pages: Vec<(&'static str, &str, String, String)> = vec![
        ("overview", "GET", "/".into(), String::new()),
        ("outbox", "GET", "/outbox".into(), String::new()),
        ("blocked", "GET", "/blocked".into(), String::new()),
        ("dead_letters", "GET", "/dead-letters".into(), String::new()),
        ("dead_letters_page_2", "GET", next, String::new()),
        get("dead_letters_back_to_1", &previous),
        get("dead_letters_oldest_first", "/dead-letters?sort=oldest"),
        get("dead_letters_most_attempts", "/dead-letters?sort=attempts"),
        get(
            "dead_letters_phrase_confirm_timeout",
            "/dead-letters?error=confirm+timeout",
        ),
        get(
            "dead_letters_phrase_no_route",
            "/dead-letters?error=NO_ROUTE",
        ),
        get(
            "dead_letters_phrase_does_not_exist",
            "/dead-letters?error=does+not+exist",
        ),
        get(
            "dead_letters_phrase_common",
            "/dead-letters?error=waiting+for+the+broker",
        ),
        get("not_found", "/no-such-page"),
        get("failures", "/failures"),
        get(
            "dead_letters_by_class",
            "/dead-letters?error_class=payload+too+large%3A+%3Cn%3E+bytes",
        ),
        get(
            "dead_letters_by_exchange",
            "/dead-letters?exchange=%28default%29",
        ),
        (
            "dead_letters_by_type",
            "GET",
            "/dead-letters?event_type=Event7".into(),
            String::new(),
        ),
        (
            "dead_letters_by_aggregate",
            "GET",
            "/dead-letters?aggregate_type=agg3&aggregate_id=id-3".into(),
            String::new(),
        ),
        (
            "dead_letters_by_time",
            "GET",
            "/dead-letters?since=2026-01-01T00:00&until=2099-01-01T00:00".into(),
            String::new(),
        ),
        (
            "dead_letters_by_error",
            "GET",
            "/dead-letters?error=PRECONDITION_FAILED".into(),
            String::new(),
        ),
        (
            "dead_letters_by_rare_error",
            "GET",
            "/dead-letters?error=zq-17".into(),
            String::new(),
        ),
        (
            "dead_letter_detail",
            "GET",
            format!("/dead-letters/{one}"),
            String::new(),
        ),
        (
            "confirm_replay_by_type",
            "POST",
            "/dead-letters/confirm".into(),
            confirm("&event_type=Event7"),
        ),
        (
            "confirm_replay_all",
            "POST",
            "/dead-letters/confirm".into(),
            confirm(""),
        ),
        (
            "confirm_replay_by_rare_error",
            "POST",
            "/dead-letters/confirm".into(),
            confirm("&error=zq-17"),
        ),
    ];
    pages.push((
        "confirm_replay_by_phrase",
        "POST",
        "/dead-letters/confirm".into(),
        confirm("&error=waiting+for+the+broker"),
    ));
    let pages = [pages, consumer_pages(port, schema).await?].concat();
    let mut out = Vec::new();
    for (name, method, path, body) in &pages {
        let mut times = Vec::with_capacity(requests);
        for _ in 0..requests {
            let (status, text) = http(port, method, path, &cookie, body).await?;
            let want = if *name == "not_found" { 404 } else { 200 };
            anyhow::ensure!(status == want, "{name}: HTTP {status}");
            times.push(server_ms(&text).context("no Server-Timing")?);
        }
        times.sort_by(f64::total_cmp);
        out.push(PageTimes {
            name: name.to_string(),
            p50: percentile(&times, 0.5),
            p95: percentile(&times, 0.95),
        });
    }
    // The refresher's read, in this process (the same library calls).
    let ident = outbox::Ident::new("schema", schema)?;
    let mut refresh = Vec::with_capacity(requests);
    for _ in 0..requests {
        let t = Instant::now();
        outbox_relay_ops::admin::gauges(pool, &ident).await?;
        outbox_relay_ops::admin::relays(pool, &ident).await?;
        outbox_relay_ops::admin::publish_rates(pool, &ident, 60).await?;
        outbox_relay_ops::admin::backlog_by_type(pool, &ident).await?;
        refresh.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    refresh.sort_by(f64::total_cmp);
    out.push(reconcile_compare(port, schema, requests.min(20)).await?);
    Ok(Phase {
        pages: out,
        refresh_p95: percentile(&refresh, 0.95),
        figures,
    })
}

// The consumer pages: a consumer `stock` whose inbox (in the same schema)
// holds 99% of a window of archived events (the 100,000 with the
// full sizes), beside a second consumer's rows; its queue has 200 dead
// letters.

fn bench_amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn consumer_queue(schema: &str) -> String {
    format!("bench.console.{schema}")
}

/// The window reconciled: the archived events' publish times.
const WINDOW: &str = "since=2000-01-01T00:00&until=2099-01-01T00:00";

async fn seed_consumer(pool: &PgPool, schema: &str, archived: i64) -> Result<()> {
    outbox_consumer::migrate(pool, schema).await?;
    let s = format!("\"{schema}\"");
    for sql in [
        format!(
            "INSERT INTO {s}.outbox_archive (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts, published_at)
             SELECT gen_random_uuid(), 'order', 'o-' || g, 'OrderPlaced', jsonb_build_object('n', g), '{{}}',
                    now() - interval '3 hours', 1, now() - interval '3 hours' + g * interval '50 ms'
             FROM generate_series(1, {archived}) g"
        ),
        format!("INSERT INTO {s}.inbox_processed (consumer, event_id, event_at, processed_at)
                 SELECT c, id::text, {s}.inbox_event_time(id::text), published_at + interval '1 second' FROM {s}.outbox_archive,
                        (VALUES ('stock'), ('billing')) v(c) WHERE c = 'billing' OR hashtext(id::text) % 100 <> 0"),
        format!("VACUUM ANALYZE {s}.outbox_archive"),
        format!("VACUUM ANALYZE {s}.inbox_processed"),
    ] {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
    }
    let queue = consumer_queue(schema);
    // The exchange is the queue's name, so the section deletes it too.
    let topology = outbox_consumer::TopologyConfig::new(&queue, &queue, "order.*");
    outbox_consumer::declare_topology_at(bench_amqp_url(), &topology).await?;
    let conn = lapin::Connection::connect(&bench_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    for i in 0..200 {
        let props = lapin::BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_type("OrderPlaced".into());
        let reason =
            lapin::types::AMQPValue::LongString(format!("handler failed: case {}", i % 7).into());
        let mut h = lapin::types::FieldTable::default();
        h.insert("x-dead-letter-reason".into(), reason);
        let dlq = format!("{queue}.dlq");
        ch.basic_publish(
            "".into(),
            dlq.as_str().into(),
            Default::default(),
            b"{}",
            props.with_headers(h),
        )
        .await?;
    }
    conn.close(200, "seeded".into()).await?;
    Ok(())
}

/// The consumer's queues and its exchange.
async fn delete_consumer_queues(schema: &str) -> Result<()> {
    let conn = lapin::Connection::connect(&bench_amqp_url(), Default::default()).await?;
    let ch = conn.create_channel().await?;
    let q = consumer_queue(schema);
    for name in [q.clone(), format!("{q}.retry"), format!("{q}.dlq")] {
        ch.queue_delete(name.as_str().into(), Default::default())
            .await?;
    }
    ch.exchange_delete(q.as_str().into(), Default::default())
        .await?;
    conn.close(200, "done".into()).await?;
    Ok(())
}

type Page = (&'static str, &'static str, String, String);

/// The consumer pages, after the reconciliation's first request started
/// its comparison and it finished (the page then answers from its result).
async fn consumer_pages(port: u16, schema: &str) -> Result<Vec<Page>> {
    let reconcile = format!("/reconcile?consumer=stock&{WINDOW}");
    wait_for_comparison(port, &reconcile).await?;
    let queue = consumer_queue(schema);
    Ok(vec![
        ("consumers", "GET", "/consumers".into(), String::new()),
        (
            "consumer_dead_letters",
            "GET",
            format!("/consumers/dlq?queue={queue}"),
            String::new(),
        ),
        (
            "consumer_dead_letters_by_reason",
            "GET",
            format!("/consumers/dlq?queue={queue}&reason_words=case+3"),
            String::new(),
        ),
        ("reconcile_100k", "GET", reconcile, String::new()),
    ])
}

async fn wait_for_comparison(port: u16, path: &str) -> Result<f64> {
    let started = Instant::now();
    loop {
        let (status, text) = http(port, "GET", path, "", "").await?;
        anyhow::ensure!(status == 200, "{path}: HTTP {status}");
        if text.contains("id=\"missing-count\"") {
            return Ok(started.elapsed().as_secs_f64() * 1000.0);
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "no comparison within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The reconciliation's comparison itself (in the background): time from
/// the first request of a new window to its result, `n` windows.
async fn reconcile_compare(port: u16, _schema: &str, n: usize) -> Result<PageTimes> {
    let mut times = Vec::new();
    for i in 0..n {
        // A window the console has not compared yet (its end a second later).
        let path = format!(
            "/reconcile?consumer=stock&since=2000-01-01T00:00&until=2099-01-01T00:00:{:02}",
            i % 60 + 1
        );
        times.push(wait_for_comparison(port, &path).await?);
    }
    times.sort_by(f64::total_cmp);
    Ok(PageTimes {
        name: "reconcile_100k_comparison_background".to_owned(),
        p50: percentile(&times, 0.5),
        p95: percentile(&times, 0.95),
    })
}
