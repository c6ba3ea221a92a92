//! Flags and environment → one validated config → the command.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use outbox::Ident;
use outbox::redact::{redact_url, redact_urls, scrub};
use outbox_relay::admin::{self, Selection};
use outbox_relay::{Relay, RelayConfig, WalCapture};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `println!` that treats a closed pipe as success and other errors as errors.
macro_rules! say {
    ($($t:tt)*) => { emit(&format!("{}\n", format_args!($($t)*)))? };
}

/// Publishes events from a PostgreSQL transactional outbox to RabbitMQ, at
/// least once, and manages the outbox (migrations, status, dead letters).
///
/// Every flag can also be set with the environment variable shown. URLs
/// may carry passwords; they are never printed (not here, not in logs).
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("OUTBOX_RELAY_BUILD"), ")"), about, long_about = None)]
pub(crate) struct Args {
    /// PostgreSQL URL of the producer's database. TLS with `?sslmode=require`
    /// (or verify-full with `sslrootcert=`).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    /// Schema holding the outbox tables.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public", global = true)]
    schema: String,

    /// Log format on stderr.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub(crate) log_format: LogFormat,

    /// A database statement that takes longer than this is logged at WARN
    /// (with its text); faster ones are not logged. The relay's
    /// maintenance statements (the lease round, the stats) take seconds on
    /// a saturated machine: below this they are normal, not news.
    #[arg(long, env = "OUTBOX_SLOW_STATEMENT", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    slow_statement: Duration,

    #[command(subcommand)]
    command: Command,
}

/// Which capture path: the outbox table, or the table and the write-ahead log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CaptureArg {
    /// The outbox table only.
    Table,
    /// The outbox table and the write-ahead log (`outbox::Capture::Wal`).
    Wal,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish the outbox until SIGTERM or SIGINT (then drain and exit 0).
    Run(Box<RunArgs>),
    /// Create or upgrade the outbox tables (a no-op when up to date).
    Migrate {
        /// `wal` also creates what the write-ahead-log capture reads
        /// (docs/WAL_CAPTURE.md): an empty publication and a logical
        /// replication slot of one name (see --slot), where missing, and
        /// records that name in the schema, where producers and relays
        /// find it. Needs wal_level = logical and a role with REPLICATION.
        /// From then on the slot keeps the WAL until a relay runs with
        /// `--capture wal`.
        #[arg(long, value_enum, default_value_t = CaptureArg::Table)]
        capture: CaptureArg,
        /// With `--capture wal`: the slot's (and publication's) name.
        /// Default: the name the schema records, else `outbox_<schema>`.
        /// Slot names are cluster-wide: a second database with a schema
        /// of the same name needs another, e.g. `outbox_<database>_<schema>`.
        #[arg(long, value_name = "NAME")]
        slot: Option<String>,
    },
    /// Backlog, age of the oldest pending event, retries and dead letters.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, replay or purge events that exhausted their attempts.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// Ordered aggregates held up by a failing event: list them, skip the
    /// event (to the dead letters) or retry it now.
    #[command(subcommand)]
    Blocked(BlockedCommand),
    /// Which aggregate types are ordered, for every writer of the outbox
    /// (docs/ORDERING.md). Needs the rights of the schema's owner.
    #[command(subcommand)]
    Ordering(OrderingCommand),
    /// Serve the operator console: a web UI to watch the outbox and mend it
    /// (replay or purge dead letters, unblock ordered aggregates).
    ///
    /// Listens on loopback unless credentials are set, from the environment
    /// only: OUTBOX_CONSOLE_PASSWORD (HTTP basic auth as --user) or
    /// OUTBOX_CONSOLE_TOKEN (a bearer token). Every action is logged (log
    /// target `outbox_console_audit`). See docs/OPERATIONS.md, "Console".
    Console(ConsoleArgs),
}

#[derive(Debug, ClapArgs)]
struct ConsoleArgs {
    /// Address to listen on. Any non-loopback address is refused unless
    /// OUTBOX_CONSOLE_PASSWORD or OUTBOX_CONSOLE_TOKEN is set.
    #[arg(long, env = "OUTBOX_CONSOLE_LISTEN", default_value = "127.0.0.1:9180")]
    listen: SocketAddr,
    /// Show the outbox, change nothing: every action is refused.
    #[arg(long, env = "OUTBOX_CONSOLE_READ_ONLY")]
    read_only: bool,
    /// Path prefix of every page, when a reverse proxy forwards
    /// `/<prefix>/...` unchanged (for example `/outbox`). Needs
    /// credentials: behind a proxy every visitor arrives from loopback.
    #[arg(long, env = "OUTBOX_CONSOLE_BASE_PATH", default_value = "")]
    base_path: String,
    /// User name for HTTP basic auth (the password comes from
    /// OUTBOX_CONSOLE_PASSWORD).
    #[arg(long, env = "OUTBOX_CONSOLE_USER", default_value = "admin")]
    user: String,
    /// Consumers' dedup retention window: replaying an event older than
    /// this is allowed but warned about (consumers may have forgotten it).
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// How often the overview's figures (estimates and index probes, never
    /// a table scan) are read again.
    #[arg(long, env = "OUTBOX_CONSOLE_REFRESH", default_value = "5s", value_parser = humantime::parse_duration)]
    refresh: Duration,
    /// RabbitMQ URL for the consumer pages (queue depths, dead-letter
    /// queues, reconciliation); without it they say how to turn them on.
    /// For a cluster, each node's URL (repeat the flag, or separate them
    /// with commas; a comma in a password as %2C). Never printed.
    #[arg(
        long,
        env = "OUTBOX_CONSOLE_AMQP_URL",
        hide_env_values = true,
        value_delimiter = ','
    )]
    amqp_url: Vec<String>,
    /// A consumer's work queue to show, as `QUEUE` or `CONSUMER=QUEUE`
    /// (`CONSUMER`: the consumer name its inbox rows carry, which the
    /// reconciliation needs). Its `QUEUE.retry` and `QUEUE.dlq` are shown
    /// with it. Repeat the flag, or separate them with commas.
    #[arg(long, env = "OUTBOX_CONSOLE_CONSUMER_QUEUE", value_delimiter = ',')]
    consumer_queue: Vec<String>,
    /// Schema of the consumers' inbox table, in the same database.
    /// Default: --schema.
    #[arg(long, env = "OUTBOX_CONSOLE_INBOX_SCHEMA")]
    inbox_schema: Option<String>,
}

#[derive(Debug, Subcommand)]
enum OrderingCommand {
    /// List the ordered aggregate types (`*`: every type).
    List,
    /// Order these aggregate types: from the next insert on, every event of
    /// them, whoever writes it, takes the next number of its aggregate.
    /// `*` orders every type.
    Add {
        /// Aggregate types.
        #[arg(required = true)]
        types: Vec<String>,
    },
    /// Stop ordering these aggregate types (events already numbered keep
    /// their numbers and are still published in order).
    Remove {
        /// Aggregate types.
        #[arg(required = true)]
        types: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum BlockedCommand {
    /// List blocked aggregates, oldest first: the failing event, its error
    /// and how many events wait behind it.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Move these events to the dead-letter table so their aggregates move
    /// on. Consumers see a gap in the aggregate's sequence (see
    /// docs/ORDERING.md); the event can be replayed later.
    Skip {
        /// Event ids (from `blocked list`).
        #[arg(required = true)]
        ids: Vec<Uuid>,
        /// Why, recorded as the dead letter's error.
        #[arg(long, default_value = "no reason given")]
        reason: String,
    },
    /// Make these events due now instead of at their next backoff.
    Retry {
        /// Event ids (from `blocked list`).
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
}

#[derive(Debug, Subcommand)]
enum DeadLetterCommand {
    /// List dead letters, newest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Put dead letters back in the outbox (same event id, attempts reset).
    Replay {
        #[command(flatten)]
        target: Target,
        /// Consumers' dedup retention window: replaying an event older than
        /// this is allowed but warned about (consumers may have forgotten it).
        #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
        retention: Duration,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Debug, ClapArgs)]
#[group(required = true, multiple = false)]
struct Target {
    /// Every dead letter.
    #[arg(long)]
    all: bool,
    /// These event ids.
    ids: Vec<Uuid>,
}

impl Target {
    fn selection(&self) -> Selection {
        if self.all {
            Selection::All
        } else {
            Selection::Ids(self.ids.clone())
        }
    }
}

#[derive(Debug, ClapArgs)]
struct RunArgs {
    /// RabbitMQ URL (`amqp://` or `amqps://` for TLS). For a cluster, give
    /// each node's URL (repeat the flag, or separate them with commas): the
    /// relay connects to the first that answers and stays on it; once a
    /// session there fails, it starts with the next. Write a comma in a
    /// password as %2C.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        value_delimiter = ',',
        required = true
    )]
    amqp_url: Vec<String>,
    /// Exchange for events whose `exchange` column is NULL.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    exchange: String,
    /// Declare that exchange (durable) at start with this type, or `none`
    /// to leave the broker's topology alone.
    #[arg(long, env = "OUTBOX_DECLARE_EXCHANGE", default_value = "topic")]
    declare_exchange: String,
    /// Events published per batch (one database transaction each).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500)]
    batch_size: usize,
    /// Batches in flight at once.
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 2)]
    workers: usize,
    /// Longest wait between polls without a wake-up.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "500ms", value_parser = humantime::parse_duration)]
    poll_interval: Duration,
    /// Do not LISTEN for wake-ups (poll only).
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    no_listen: bool,
    /// Attempts before an event is dead-lettered. Ordered events are never
    /// dead-lettered by the relay: they block their aggregate until delivered
    /// or skipped (`outbox-relay blocked`).
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 10)]
    max_attempts: i32,
    /// First retry delay (doubles per attempt, with jitter).
    #[arg(long, env = "OUTBOX_RETRY_BASE", default_value = "1s", value_parser = humantime::parse_duration)]
    retry_base: Duration,
    /// Longest retry delay.
    #[arg(long, env = "OUTBOX_RETRY_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    retry_max: Duration,
    /// How long to wait for a batch's publisher confirms.
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    confirm_timeout: Duration,
    /// Bound on connecting and every other broker operation.
    #[arg(long, env = "OUTBOX_BROKER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    broker_timeout: Duration,
    /// Largest payload published; bigger events are dead-lettered.
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES", default_value_t = outbox::DEFAULT_MAX_PAYLOAD_BYTES)]
    max_payload_bytes: usize,
    /// Keep delivered events in `outbox_published` instead of deleting them.
    #[arg(long, env = "OUTBOX_ARCHIVE")]
    archive: bool,
    /// On SIGTERM/SIGINT, how long to finish the batches in flight.
    #[arg(long, env = "OUTBOX_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address.
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Lease time of ordered-event partitions: when a relay dies, the
    /// others take over its partitions after at most about this long (at
    /// once when it shuts down cleanly).
    #[arg(long, env = "OUTBOX_LEASE_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// This relay's name in `status` (default `<hostname>-<pid>`).
    #[arg(long, env = "OUTBOX_RELAY_NAME")]
    name: Option<String>,
    /// `wal` also publishes the events producers write to the write-ahead
    /// log (`outbox::Capture::Wal`), read from the replication slot the
    /// schema records (create it with `migrate --capture wal`). One
    /// relay reads the slot; others wait as standbys and take over when it
    /// stops. The outbox table is served either way. docs/WAL_CAPTURE.md.
    #[arg(long, env = "OUTBOX_CAPTURE", value_enum, default_value_t = CaptureArg::Table)]
    capture: CaptureArg,
    /// With `--capture wal`: how long PostgreSQL waits for a silent reader
    /// (a frozen or cut-off relay) before it frees the slot for a standby.
    #[arg(long, env = "OUTBOX_WAL_SENDER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    wal_sender_timeout: Duration,
}

pub(crate) fn init_logging(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // lapin logs a broker outage from inside its IO loop at ERROR; the
    // relay handles it (fails over, reconnects) and logs it itself at WARN
    // with the cause. Its lines only when RUST_LOG asks for them by name.
    if !std::env::var("RUST_LOG").is_ok_and(|v| v.contains("lapin")) {
        filter = filter.add_directive("lapin=off".parse().expect("a constant directive parses"));
    }
    // Colours only on a terminal: a log file or collector gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Strips passwords of the URLs in the environment from `text`.
pub(crate) fn scrub_secrets(text: &str) -> String {
    ["DATABASE_URL", "AMQP_URL"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .fold(text.to_owned(), |t, url| scrub(&t, &url))
}

pub(crate) async fn run(args: Args) -> Result<ExitCode> {
    let schema = Ident::new("schema", &args.schema)?;
    let Some(url) = args.database_url.as_deref() else {
        bail!("no database URL: set DATABASE_URL or pass --database-url");
    };
    let result = dispatch(&args, url, &schema).await;
    // Errors of the libraries below may quote the URLs they were given.
    result.map_err(|e| anyhow::anyhow!(scrub(&scrub(&one_line(&e), url), &amqp_url(&args))))
}

/// The error and its causes on one line, each said once: a library error
/// that quotes its source would otherwise print it again after itself
/// (`database: X: X`).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn amqp_url(args: &Args) -> String {
    match &args.command {
        Command::Run(r) => r.amqp_url.join(","),
        Command::Console(c) => c.amqp_url.join(","),
        _ => String::new(),
    }
}

async fn dispatch(args: &Args, url: &str, schema: &Ident) -> Result<ExitCode> {
    let pool = connect_db(url, 8, args.slow_statement).await?;
    match &args.command {
        Command::Migrate { capture, slot } => {
            if slot.is_some() && *capture != CaptureArg::Wal {
                bail!(
                    "--slot names the write-ahead-log capture's slot: give it with --capture wal"
                );
            }
            let applied = outbox::migrate(&pool, schema.as_str())
                .await
                .context("migration failed")?;
            if applied.is_empty() {
                say!("schema {schema} is up to date");
            } else {
                say!("schema {schema}: applied migrations {applied:?}");
            }
            if *capture == CaptureArg::Wal {
                let done = admin::create_wal_slot(&pool, schema, slot.as_deref())
                    .await
                    .context("setting up the write-ahead-log capture")?;
                let slot = &done.slot;
                say!(
                    "publication {slot} {}; replication slot {slot} {}",
                    if done.publication_created {
                        "created"
                    } else {
                        "exists"
                    },
                    if done.slot_created {
                        "created"
                    } else {
                        "exists"
                    }
                );
            }
        }
        Command::Status { json } => {
            let s = admin::status(&pool, schema)
                .await
                .context("reading the outbox status")?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print_status(&s)?;
            }
        }
        Command::DeadLetters(cmd) => dead_letters(&pool, schema, cmd).await?,
        Command::Blocked(cmd) => blocked(&pool, schema, cmd).await?,
        Command::Ordering(cmd) => ordering(&pool, schema, cmd).await?,
        Command::Run(r) => return run_relay(url, schema, r, args.slow_statement).await,
        Command::Console(c) => {
            let options = crate::console::Options {
                listen: c.listen,
                base_path: c.base_path.trim_end_matches('/').to_owned(),
                read_only: c.read_only,
                credentials: crate::console::Credentials::from_env(&c.user),
                retention: c.retention,
                refresh: c.refresh.max(Duration::from_millis(100)),
                database_url: url.to_owned(),
                consumers: crate::console::ConsumerOptions::new(
                    &c.amqp_url,
                    &c.consumer_queue,
                    c.inbox_schema.as_deref().unwrap_or(schema.as_str()),
                )?,
            };
            let shutdown = CancellationToken::new();
            let signals =
                tokio::spawn(wait_for_signal(outbox::shutdown_signal(), shutdown.clone()));
            let served = crate::console::serve(pool, schema.clone(), options, shutdown).await;
            signals.abort();
            served?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn connect_db(url: &str, max: u32, slow: Duration) -> Result<PgPool> {
    outbox::redact::check_url(url, "database URL", &["postgres", "postgresql"])
        .map_err(anyhow::Error::msg)?;
    // sqlx's parse errors do not quote the URL; say which setting anyway.
    let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
        anyhow::anyhow!("database URL is malformed: {}", scrub(&e.to_string(), url))
    })?;
    // Bounds on the database side: no statement runs forever, and a relay
    // frozen inside a transaction (SIGSTOP, a hung broker) loses its
    // session and its row locks instead of holding them for ever. No JIT:
    // these are short statements, and on a table never analysed the
    // planner's inflated costs made PostgreSQL compile one for 275 ms that
    // then ran in 2 ms (the console's blocked page).
    let options = options
        .application_name("outbox-relay")
        .options([
            ("statement_timeout", "30s"),
            ("idle_in_transaction_session_timeout", "60s"),
            ("jit", "off"),
        ])
        .log_slow_statements(log::LevelFilter::Warn, slow);
    // One direct connection first: its error names the cause (refused,
    // auth, TLS), where a pool would only report a timeout.
    let probe = tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await;
    let context = || format!("cannot connect to the database at {}", redact_url(url));
    match probe {
        Ok(conn) => conn
            .with_context(context)?
            .close()
            .await
            .with_context(context)?,
        Err(_) => bail!("{}: no answer within 10s", context()),
    }
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options))
}

async fn run_relay(url: &str, schema: &Ident, r: &RunArgs, slow: Duration) -> Result<ExitCode> {
    let mut config = RelayConfig::default();
    config.amqp_url = r.amqp_url.join(",").into();
    config.schema = schema.to_string();
    config.default_exchange = r.exchange.clone();
    config.declare_exchange = (r.declare_exchange != "none").then(|| r.declare_exchange.clone());
    config.batch_size = r.batch_size;
    config.workers = r.workers;
    config.poll_interval = r.poll_interval;
    config.listen = !r.no_listen;
    config.max_attempts = r.max_attempts;
    config.retry_base = r.retry_base;
    config.retry_max = r.retry_max;
    config.confirm_timeout = r.confirm_timeout;
    config.broker_timeout = r.broker_timeout;
    config.max_payload_bytes = r.max_payload_bytes;
    config.archive = r.archive;
    config.drain_timeout = r.drain_timeout;
    config.lease_ttl = r.lease_ttl;
    if let Some(name) = &r.name {
        config.name = name.clone();
    }
    if r.capture == CaptureArg::Wal {
        // The replication connection goes where the pool goes.
        let mut wal = WalCapture::new(url);
        wal.sender_timeout = r.wal_sender_timeout;
        config.wal = Some(wal);
    }
    config.validate()?;
    let pool = connect_db(url, r.workers as u32 + 3, slow).await?;
    let relay = Relay::new(pool.clone(), config).await?;
    // Fail fast with one line when the broker is unreachable at start;
    // after that the supervisor reconnects by itself.
    relay.connect().await?.close(r.broker_timeout).await;
    if let Some(addr) = r.metrics_addr {
        crate::http::serve(addr, relay.health(), pool.clone(), schema.clone()).await?;
    }
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(outbox::shutdown_signal(), shutdown.clone()));
    tracing::info!(schema = %schema, exchange = %r.exchange, brokers = %redact_urls(&r.amqp_url.join(",")), "relay started");
    let mut run = tokio::spawn({
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    tokio::select! {
        res = &mut run => {
            signals.abort();
            res.context("relay task failed")??;
            return Ok(ExitCode::SUCCESS);
        }
        _ = shutdown.cancelled() => {}
    }
    tracing::info!(drain_timeout = ?r.drain_timeout, "shutting down: finishing batches in flight");
    // The engine bounds the drain by `drain_timeout` itself.
    run.await.context("relay task failed")??;
    tracing::info!("drained; bye");
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal(signal: impl Future<Output = ()>, shutdown: CancellationToken) {
    signal.await;
    shutdown.cancel();
}

/// Writes command output to stdout; a closed pipe (`| head`) is not an error.
fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn print_status(s: &admin::Status) -> Result<()> {
    let age = s
        .oldest_pending_age_s
        .map_or("-".to_owned(), |a| format!("{a:.1}s"));
    say!("{:<24}{}", "backlog", s.backlog);
    say!("{:<24}{}", "due now", s.due);
    say!("{:<24}{}", "oldest pending age", age);
    say!("{:<24}{}", "retrying", s.retrying);
    say!("{:<24}{}", "dead letters", s.dead_letters);
    say!("{:<24}{}", "blocked aggregates", s.blocked_aggregates);
    say!("{:<24}{}", "unleased partitions", s.unleased_partitions);
    if let Some(w) = &s.wal {
        let lag = w.lag_bytes.map_or("-".to_owned(), |b| format!("{b} bytes"));
        let reader = match (&w.reader, w.active) {
            (Some(r), true) => r.clone(),
            (None, true) => "a session".to_owned(),
            (_, false) => "NONE (no relay reads it; the WAL piles up)".to_owned(),
        };
        say!(
            "{:<24}{} ({})",
            "wal slot",
            w.slot,
            w.wal_status.as_deref().unwrap_or("?")
        );
        say!("{:<24}{}", "wal reader", reader);
        say!("{:<24}{}", "wal lag", lag);
        if let Some(t) = w.lag_s {
            say!("{:<24}{t:.3}s", "wal lag (time)");
        }
        if let Some(safe) = w.safe_wal_size {
            say!("{:<24}{safe} bytes", "wal until invalidated");
        }
    }
    for r in &s.relays {
        say!(
            "  relay {:<30} {:>2} partitions, heartbeat {:.1}s ago, broker {}",
            r.name,
            r.partitions,
            r.heartbeat_age_s,
            r.broker.as_deref().unwrap_or("unknown")
        );
    }
    if !s.blocked.is_empty() {
        say!("\nblocked aggregates (oldest first):");
        print_blocked(&s.blocked)?;
    }
    if !s.failing.is_empty() {
        say!("\nfailing events (most attempts first):");
        say!(
            "{:<38} {:<24} {:>8}  {:<25} last error",
            "id",
            "event type",
            "attempts",
            "next attempt"
        );
        for f in &s.failing {
            say!(
                "{:<38} {:<24} {:>8}  {:<25} {}",
                f.id,
                f.event_type,
                f.attempts,
                f.next_attempt_at.format("%Y-%m-%d %H:%M:%S%.3f"),
                f.last_error.as_deref().unwrap_or("")
            );
        }
    }
    // Dead letters by error class, event type and exchange (nothing when none).
    emit(&s.failures.to_string())
}

fn print_blocked(rows: &[admin::BlockedAggregate]) -> Result<()> {
    say!(
        "{:<30} {:<38} {:>6} {:>8} {:>8}  {:<25} last error",
        "aggregate",
        "failing event",
        "seq",
        "attempts",
        "waiting",
        "next attempt"
    );
    for b in rows {
        say!(
            "{:<30} {:<38} {:>6} {:>8} {:>8}  {:<25} {}",
            format!("{}/{}", b.aggregate_type, b.aggregate_id),
            b.event_id,
            b.aggregate_seq,
            b.attempts,
            b.waiting,
            b.next_attempt_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            b.last_error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

async fn ordering(pool: &PgPool, schema: &Ident, cmd: &OrderingCommand) -> Result<()> {
    let (types, ordered) = match cmd {
        OrderingCommand::List => {
            let types = outbox::ordered_types(pool, schema.as_str()).await?;
            if types.is_empty() {
                say!("no ordered aggregate types");
            }
            for t in types {
                say!("{t}");
            }
            return Ok(());
        }
        OrderingCommand::Add { types } => (types, true),
        OrderingCommand::Remove { types } => (types, false),
    };
    for t in types {
        outbox::set_ordered(pool, schema.as_str(), t, ordered)
            .await
            .with_context(|| format!("changing the ordering of aggregate type {t:?}"))?;
        say!(
            "aggregate type {t:?} is {}ordered",
            if ordered { "" } else { "no longer " }
        );
    }
    Ok(())
}

async fn blocked(pool: &PgPool, schema: &Ident, cmd: &BlockedCommand) -> Result<()> {
    match cmd {
        BlockedCommand::List { limit, json } => {
            let rows = admin::blocked_aggregates(pool, schema, *limit).await?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                say!("no blocked aggregates");
            } else {
                print_blocked(&rows)?;
            }
        }
        BlockedCommand::Skip { ids, reason } => {
            let n = admin::skip_events(pool, schema, ids, reason).await?;
            say!("skipped {n} event(s): moved to the dead letters");
            if n < ids.len() as u64 {
                eprintln!(
                    "warning: {} of the ids were not in the outbox (delivered, or dead-lettered already)",
                    ids.len() as u64 - n
                );
            }
        }
        BlockedCommand::Retry { ids } => {
            let n = admin::retry_now(pool, schema, ids).await?;
            say!("{n} event(s) due now");
        }
    }
    Ok(())
}

async fn dead_letters(pool: &PgPool, schema: &Ident, cmd: &DeadLetterCommand) -> Result<()> {
    match cmd {
        DeadLetterCommand::List { limit, json } => {
            let rows = admin::list_dead_letters(pool, schema, *limit).await?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                say!("no dead letters");
            } else {
                say!(
                    "{:<38} {:<24} {:>8}  {:<20} last error",
                    "id",
                    "event type",
                    "attempts",
                    "dead-lettered at"
                );
                for d in rows {
                    say!(
                        "{:<38} {:<24} {:>8}  {:<20} {}",
                        d.id,
                        d.event_type,
                        d.attempts,
                        d.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
                        d.last_error
                    );
                }
            }
        }
        DeadLetterCommand::Replay { target, retention } => {
            let r = admin::replay_dead_letters(pool, schema, &target.selection(), *retention, None)
                .await?;
            say!("replayed {} event(s) into the outbox", r.replayed);
            if !r.conflicts.is_empty() {
                eprintln!(
                    "kept {} dead letter(s) whose id is already in the outbox (enqueued again or replayed before); purge them if the outbox copy is the one to keep: {}",
                    r.conflicts.len(),
                    some_ids(&r.conflicts)
                );
            }
            if !r.unpublishable.is_empty() {
                eprintln!(
                    "kept {} dead letter(s) the outbox refuses (a name over 255 bytes); they can never be published as they are: {}",
                    r.unpublishable.len(),
                    some_ids(&r.unpublishable)
                );
            }
            if !r.older_than_retention.is_empty() {
                eprintln!(
                    "warning: {} replayed event(s) are older than the retention window ({}); consumers may apply them again: {}",
                    r.older_than_retention.len(),
                    humantime::format_duration(*retention),
                    some_ids(&r.older_than_retention)
                );
            }
        }
        DeadLetterCommand::Purge { target } => {
            let ids = admin::purge_dead_letters(pool, schema, &target.selection(), None).await?;
            say!("purged {} dead letter(s)", ids.len());
        }
    }
    Ok(())
}

/// The first 20 of `ids`, and how many more (a replay of every dead letter
/// may name hundreds of thousands).
fn some_ids(ids: &[Uuid]) -> String {
    let shown: Vec<String> = ids.iter().take(20).map(Uuid::to_string).collect();
    match ids.len().saturating_sub(shown.len()) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}
