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
    pub(crate) name: &'static str,
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
                    jsonb_build_object('n', g, 'note', repeat('y', 150)), '{{}}'::jsonb, now() - interval '8 days', 10,
                    (ARRAY['NO_ROUTE: no queue bound to the exchange', 'payload too large: 2000000 bytes',
                           'timeout waiting for the broker''s confirm', 'broker returned 406 PRECONDITION_FAILED',
                           'channel closed: 320 CONNECTION_FORCED', 'nacked by the broker'])[1 + g % 6]
                        || CASE WHEN g % 50000 = 7 THEN ' (rare marker zq-17)' ELSE '' END,
                    jsonb_build_array(jsonb_build_object('at', now() - interval '8 days', 'error', 'first attempt failed')),
                    now() - (g * (604800.0 / {dead})) * interval '1 second'
             FROM generate_series(1, {dead}) g"
        ),
        format!("VACUUM ANALYZE {s}.outbox"),
        format!("VACUUM ANALYZE {s}.outbox_dead_letters"),
    ];
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
    let seed_secs = started.elapsed().as_secs_f64();
    let result = measure_pages(pool, database_url, &schema, seed_sizes.requests).await;
    drop_schema(pool, &schema).await?;
    Ok(ConsoleTimes {
        seed_secs,
        ..result?
    })
}

async fn measure_pages(
    pool: &PgPool,
    database_url: &str,
    schema: &str,
    requests: usize,
) -> Result<ConsoleTimes> {
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

async fn pages(pool: &PgPool, port: u16, schema: &str, requests: usize) -> Result<ConsoleTimes> {
    // The CSRF cookie and token, as a browser gets them.
    let (_, first) = http(port, "GET", "/dead-letters", "", "").await?;
    let token = between(&first, "outbox_console_csrf=", ";")
        .context("no CSRF cookie")?
        .to_owned();
    let cookie = format!("outbox_console_csrf={token}");
    let next = between(&first, "id=\"next-page\" href=\"", "\"")
        .context("no second page")?
        .replace("&amp;", "&");
    let one: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM \"{schema}\".outbox_dead_letters ORDER BY dead_lettered_at LIMIT 1 OFFSET 5"
    )))
    .fetch_one(pool)
    .await?;
    let confirm = |filter: &str| format!("csrf={token}&action=replay&scope=matching{filter}");
    let pages: Vec<(&'static str, &str, String, String)> = vec![
        ("overview", "GET", "/".into(), String::new()),
        ("outbox", "GET", "/outbox".into(), String::new()),
        ("blocked", "GET", "/blocked".into(), String::new()),
        ("dead_letters", "GET", "/dead-letters".into(), String::new()),
        ("dead_letters_page_2", "GET", next, String::new()),
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
    let mut out = Vec::new();
    for (name, method, path, body) in &pages {
        let mut times = Vec::with_capacity(requests);
        for _ in 0..requests {
            let (status, text) = http(port, method, path, &cookie, body).await?;
            anyhow::ensure!(status == 200, "{name}: HTTP {status}");
            times.push(server_ms(&text).context("no Server-Timing")?);
        }
        times.sort_by(f64::total_cmp);
        out.push(PageTimes {
            name,
            p50: percentile(&times, 0.5),
            p95: percentile(&times, 0.95),
        });
    }
    // The refresher's read, in this process (the same library calls).
    let ident = outbox::Ident::new("schema", schema)?;
    let mut refresh = Vec::with_capacity(requests);
    for _ in 0..requests {
        let t = Instant::now();
        outbox_relay::admin::gauges(pool, &ident).await?;
        outbox_relay::admin::relays(pool, &ident).await?;
        outbox_relay::admin::publish_rates(pool, &ident, 60).await?;
        outbox_relay::admin::backlog_by_type(pool, &ident).await?;
        refresh.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    refresh.sort_by(f64::total_cmp);
    Ok(ConsoleTimes {
        pages: out,
        refresh_p95: percentile(&refresh, 0.95),
        seed_secs: 0.0,
    })
}
