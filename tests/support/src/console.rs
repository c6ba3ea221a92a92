//! What the console's tests share: a console process on its own port
//! ([`Console`]), relay processes, and the rows the pages are tried on;
//! the browser is [`crate::browser::Browser`].

use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::{KillOnDrop, TestBroker, TestDb, database_url};
pub use crate::{free_port, wait_for_port};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

/// The relay binary of the package under test (`outbox-relay-ops`): what
/// cargo or nextest names in `CARGO_BIN_EXE_outbox-relay`, else the
/// binary beside the test's own folder (`target/<profile>/outbox-relay`).
pub fn relay_bin() -> String {
    std::env::var("CARGO_BIN_EXE_outbox-relay").unwrap_or_else(|_| {
        let exe = std::env::current_exe().expect("the test's path");
        let profile = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("a test binary in target/<profile>/deps");
        profile.join("outbox-relay").to_string_lossy().into_owned()
    })
}

/// `target/<dir>/`, created: where the console tests leave screenshots and logs.
pub fn artifacts(dir: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target")
        .join(dir);
    std::fs::create_dir_all(&d).expect("artifact dir");
    d
}

/// A console process on its own port; its log goes to a file under
/// `target/console-logs/` (for the audit-log checks).
pub struct Console {
    _child: KillOnDrop,
    /// Its address (`http://127.0.0.1:<port>`).
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
}

/// `outbox-relay console` on `db`'s schema listening on `listen`, refreshing every 200 ms, logging to `log`.
pub fn console_cmd(db: &TestDb, listen: &str, log: &PathBuf) -> Command {
    let mut c = Command::new(relay_bin());
    c.env("DATABASE_URL", database_url())
        .env("OUTBOX_SCHEMA", &db.schema)
        .env("RUST_LOG", "info")
        .env_remove("OUTBOX_CONSOLE_PASSWORD")
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .args(["console", "--listen", listen, "--refresh", "200ms"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"));
    c
}

impl Console {
    /// Starts a console on a free port (`configure` adds arguments) and waits until it listens.
    pub async fn start(db: &TestDb, configure: impl FnOnce(&mut Command)) -> Console {
        let port = free_port();
        let log = artifacts("console-logs").join(format!("{}.log", db.schema));
        let mut cmd = console_cmd(db, &format!("127.0.0.1:{port}"), &log);
        configure(&mut cmd);
        let child = KillOnDrop(cmd.spawn().expect("console"));
        wait_for_port(port, "the console to listen").await;
        Console {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A relay process publishing `db`'s outbox to `broker`'s exchange.
pub fn start_relay(db: &TestDb, broker: &TestBroker) -> KillOnDrop {
    start_relay_with(db, broker, &[])
}

/// [`start_relay`] with more settings (`OUTBOX_*` variables).
pub fn start_relay_with(db: &TestDb, broker: &TestBroker, settings: &[(&str, &str)]) -> KillOnDrop {
    let child = crate::relay_command(&relay_bin(), db, broker)
        .env("OUTBOX_LEASE_TTL", "3s")
        .envs(settings.iter().copied())
        .spawn()
        .expect("relay");
    KillOnDrop(child)
}

/// Dead letters of `event_type`, as the relay would have left them:
/// `n` rows for aggregates `<prefix>-1..n`, one second apart. Returns
/// their ids.
pub async fn dead_letters(
    db: &TestDb,
    event_type: &str,
    prefix: &str,
    n: i32,
    error: &str,
) -> Vec<Uuid> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".outbox_dead_letters
             (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
              last_error, error_history, dead_lettered_at)
         SELECT gen_random_uuid(), 'payment', $2 || '-' || g, $1, jsonb_build_object('n', g, 'note', 'x'),
                '{{\"x-tenant\": \"acme\"}}', now() - interval '1 hour', 10, $3,
                jsonb_build_array(jsonb_build_object('at', now() - interval '5 minutes', 'error', 'first try: ' || $3)),
                now() - g * interval '1 second'
         FROM generate_series(1, $4) g RETURNING id",
        db.schema
    )))
    .bind(event_type)
    .bind(prefix)
    .bind(error)
    .bind(n)
    .fetch_all(&db.pool)
    .await
    .expect("dead letters")
}

/// The text between `start` and the next `end` after it.
pub fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text.find(start).unwrap_or_else(|| panic!("no {start:?}")) + start.len();
    &text[from..from + text[from..].find(end).expect("end")]
}

/// Rows of `table` in `db`'s schema matching `condition` (SQL).
pub async fn count_where(db: &TestDb, table: &str, condition: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".{table} WHERE {condition}",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("count")
}

/// An ordered aggregate `account/<id>` with `n` events whose head has
/// failed and waits an hour for its next attempt. Returns the ids in
/// sequence order.
pub async fn blocked_aggregate(db: &TestDb, id: &str, n: usize) -> Vec<Uuid> {
    outbox::set_ordered(&db.pool, &db.schema, "account", true)
        .await
        .expect("order account");
    let mut ids = Vec::new();
    for i in 0..n {
        let id: Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('account', $1, $2, '{{}}') RETURNING id",
            db.schema
        )))
        .bind(id)
        .bind(format!("AccountEvent{}", i + 1))
        .fetch_one(&db.pool)
        .await
        .expect("ordered event");
        ids.push(id);
    }
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox SET attempts = 3, last_error = 'NO_ROUTE: nobody listens for AccountEvent1',
             available_at = now() + interval '1 hour' WHERE id = $1",
        db.schema
    )))
    .bind(ids[0])
    .execute(&db.pool)
    .await
    .expect("fail the head");
    ids
}

/// `n` dead letters of `event_type` (as [`dead_letters`] leaves them,
/// aggregates `<event type, lower case>-1..n`) that were published to
/// `exchange` (`None`: the relay's default) and failed alike: in `error`,
/// `{n}` becomes a number and `{id}` a fresh UUID, different on each row,
/// so the texts differ and their error class is one. Returns their ids.
pub async fn failed_alike(
    db: &TestDb,
    event_type: &str,
    exchange: Option<&str>,
    n: i32,
    error: &str,
) -> Vec<Uuid> {
    let ids = dead_letters(db, event_type, &event_type.to_lowercase(), n, error).await;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox_dead_letters
         SET exchange = $2,
             last_error = replace(replace(last_error, '{{n}}', (1000 + 37 * split_part(aggregate_id, '-', 2)::int)::text),
                                  '{{id}}', gen_random_uuid()::text)
         WHERE id = ANY($1)",
        db.schema
    )))
    .bind(&ids)
    .bind(exchange)
    .execute(&db.pool)
    .await
    .expect("fail them alike");
    ids
}

/// The error classes [`failure_mix`] leaves, most dead letters first.
pub const NO_ROUTE_CLASS: &str = "returned by the broker: <n> NO_ROUTE (exchange \"…\")";
/// See [`NO_ROUTE_CLASS`].
pub const TOO_LARGE_CLASS: &str = "payload is <n> bytes, over the relay's limit of <n> bytes";
/// See [`NO_ROUTE_CLASS`].
pub const REJECTED_CLASS: &str = "consumer rejected event <id>";
/// See [`NO_ROUTE_CLASS`].
pub const PRECONDITION_CLASS: &str = "the broker closed the channel: <n> PRECONDITION_FAILED - message size <n> is larger than configured max size <n>";

/// Ten dead letters that failed four ways, each row's error text its own:
/// by class NO_ROUTE 4, too large 3, rejected 2, precondition 1; by event
/// type OrderPlaced 6, OrderPaid 3, Refunded 1; by exchange the relay's
/// default 5, `orders` 4, `billing` 1.
pub async fn failure_mix(db: &TestDb) {
    let rows = [
        (
            "OrderPlaced",
            Some("orders"),
            4,
            "returned by the broker: 312 NO_ROUTE (exchange \"orders-{n}\")",
        ),
        (
            "OrderPaid",
            None,
            3,
            "payload is {n} bytes, over the relay's limit of 1048576 bytes",
        ),
        ("OrderPlaced", None, 2, "consumer rejected event {id}"),
        (
            "Refunded",
            Some("billing"),
            1,
            "the broker closed the channel: 406 PRECONDITION_FAILED - message size {n} is larger than configured max size 134217728",
        ),
    ];
    for (event_type, exchange, n, error) in rows {
        failed_alike(db, event_type, exchange, n, error).await;
    }
}

/// One HTTP/1.1 request with these headers (`Host` is the URL's unless
/// given) and a form body: (status, the whole response as text).
pub async fn http_request(
    method: &str,
    url: &str,
    headers: &[(&str, String)],
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let u = url::Url::parse(url).expect("url");
    let (host, port) = (u.host_str().expect("host"), u.port().expect("port"));
    let mut s = tokio::net::TcpStream::connect((host, port))
        .await
        .expect("connect");
    let mut head = String::new();
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {host}:{port}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let target = match u.query() {
        Some(q) => format!("{}?{q}", u.path()),
        None => u.path().to_owned(),
    };
    let req = format!(
        "{method} {target} HTTP/1.1\r\n{head}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}
