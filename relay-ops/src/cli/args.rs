//! The command line: flags, environment variables and subcommands (their
//! doc comments are the `--help` text).

use std::net::SocketAddr;
use std::time::Duration;

use crate::admin::Selection;
use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use uuid::Uuid;

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
    pub(super) database_url: Option<String>,

    /// Schema holding the outbox tables.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public", global = true)]
    pub(super) schema: String,

    /// Log format on stderr.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub(crate) log_format: LogFormat,

    /// A database statement that takes longer than this is logged at WARN
    /// (with its text); faster ones are not logged. The relay's
    /// maintenance statements (the lease round, the stats) take seconds on
    /// a saturated machine: below this they are normal, not news.
    #[arg(long, env = "OUTBOX_SLOW_STATEMENT", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub(super) slow_statement: Duration,

    #[command(subcommand)]
    pub(super) command: Command,
}

/// Which capture path: the outbox table, or the table and the write-ahead log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum CaptureArg {
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
pub(super) enum Command {
    /// Publish the outbox until SIGTERM or SIGINT (then drain and exit 0).
    Run(Box<RunArgs>),
    /// Create or upgrade the outbox tables (a no-op when up to date): of
    /// --schema, or of many schemas at once (--all-schemas,
    /// --schemas-file).
    Migrate(MigrateArgs),
    /// Every schema of the database that holds the outbox, with where its
    /// migrations stand: current, behind (run `migrate`), too new for
    /// these tools, or unreadable by this role. For a schema per tenant.
    Schemas {
        /// Only the schemas whose name is LIKE this pattern (`tenant_%`).
        #[arg(long, value_name = "PATTERN")]
        like: Option<String>,
        /// Machine-readable output: one JSON array of
        /// `{"schema", "state", "version"}`.
        #[arg(long)]
        json: bool,
    },
    /// Backlog, age of the oldest pending event, retries and dead letters.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Every schema of the database that holds the outbox (a schema per
        /// tenant), instead of --schema: the totals, the tenants with the
        /// oldest pending events first (--worst), and every schema not
        /// current or not readable. One tenant that cannot be read is
        /// listed, not fatal.
        #[arg(long)]
        all_schemas: bool,
        /// With --all-schemas: only the schemas whose name is LIKE this
        /// pattern (`tenant_%`).
        #[arg(long, value_name = "PATTERN", requires = "all_schemas")]
        like: Option<String>,
        /// With --all-schemas: how many of the worst tenants to show (the
        /// rest are in the totals).
        #[arg(long, value_name = "N", default_value_t = 20, requires = "all_schemas")]
        worst: usize,
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
pub(super) struct ConsoleArgs {
    /// Address to listen on. Any non-loopback address is refused unless
    /// OUTBOX_CONSOLE_PASSWORD or OUTBOX_CONSOLE_TOKEN is set.
    #[arg(long, env = "OUTBOX_CONSOLE_LISTEN", default_value = "127.0.0.1:9180")]
    pub(super) listen: SocketAddr,
    /// Show the outbox, change nothing: every action is refused.
    #[arg(long, env = "OUTBOX_CONSOLE_READ_ONLY")]
    pub(super) read_only: bool,
    /// Path prefix of every page, when a reverse proxy forwards
    /// `/<prefix>/...` unchanged (for example `/outbox`). Needs
    /// credentials: behind a proxy every visitor arrives from loopback.
    #[arg(long, env = "OUTBOX_CONSOLE_BASE_PATH", default_value = "")]
    pub(super) base_path: String,
    /// User name for HTTP basic auth (the password comes from
    /// OUTBOX_CONSOLE_PASSWORD).
    #[arg(long, env = "OUTBOX_CONSOLE_USER", default_value = "admin")]
    pub(super) user: String,
    /// Consumers' dedup retention window: replaying an event older than
    /// this is allowed but warned about (consumers may have forgotten it).
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    pub(super) retention: Duration,
    /// How often the overview's figures (estimates and index probes, never
    /// a table scan) are read again.
    #[arg(long, env = "OUTBOX_CONSOLE_REFRESH", default_value = "5s", value_parser = humantime::parse_duration)]
    pub(super) refresh: Duration,
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
    pub(super) amqp_url: Vec<String>,
    /// A consumer's work queue to show, as `QUEUE` or `CONSUMER=QUEUE`
    /// (`CONSUMER`: the consumer name its inbox rows carry, which the
    /// reconciliation needs). Its `QUEUE.retry` and `QUEUE.dlq` are shown
    /// with it. Repeat the flag, or separate them with commas.
    #[arg(long, env = "OUTBOX_CONSOLE_CONSUMER_QUEUE", value_delimiter = ',')]
    pub(super) consumer_queue: Vec<String>,
    /// Schema of the consumers' inbox table, in the same database.
    /// Default: --schema.
    #[arg(long, env = "OUTBOX_CONSOLE_INBOX_SCHEMA")]
    pub(super) inbox_schema: Option<String>,
}

#[derive(Debug, Subcommand)]
pub(super) enum OrderingCommand {
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
pub(super) enum BlockedCommand {
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
pub(super) enum DeadLetterCommand {
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
pub(super) struct Target {
    /// Every dead letter.
    #[arg(long)]
    pub(super) all: bool,
    /// These event ids.
    pub(super) ids: Vec<Uuid>,
}

impl Target {
    pub(super) fn selection(&self) -> Selection {
        if self.all {
            Selection::All
        } else {
            Selection::Ids(self.ids.clone())
        }
    }
}

#[derive(Debug, ClapArgs)]
pub(super) struct RunArgs {
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
    pub(super) amqp_url: Vec<String>,
    /// Exchange for events whose `exchange` column is NULL.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    pub(super) exchange: String,
    /// Declare that exchange (durable) at start with this type, or `none`
    /// to leave the broker's topology alone.
    #[arg(long, env = "OUTBOX_DECLARE_EXCHANGE", default_value = "topic")]
    pub(super) declare_exchange: String,
    /// Events published per batch (one database transaction each).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500)]
    pub(super) batch_size: usize,
    /// Batches in flight at once.
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 2)]
    pub(super) workers: usize,
    /// Longest wait between polls without a wake-up.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub(super) poll_interval: Duration,
    /// Do not LISTEN for wake-ups (poll only).
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub(super) no_listen: bool,
    /// Attempts before an event is dead-lettered. Ordered events are never
    /// dead-lettered by the relay: they block their aggregate until delivered
    /// or skipped (`outbox-relay blocked`).
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 10)]
    pub(super) max_attempts: i32,
    /// First retry delay (doubles per attempt, with jitter).
    #[arg(long, env = "OUTBOX_RETRY_BASE", default_value = "1s", value_parser = humantime::parse_duration)]
    pub(super) retry_base: Duration,
    /// Longest retry delay.
    #[arg(long, env = "OUTBOX_RETRY_MAX", default_value = "5m", value_parser = humantime::parse_duration)]
    pub(super) retry_max: Duration,
    /// How long to wait for a batch's publisher confirms.
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub(super) confirm_timeout: Duration,
    /// Bound on connecting and every other broker operation.
    #[arg(long, env = "OUTBOX_BROKER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(super) broker_timeout: Duration,
    /// Bound on every database call, from the relay's side: a connection
    /// that does not answer within it (a link gone silent, no RST) is
    /// discarded, `/readyz` turns 503, one warning is logged, and the work
    /// is retried on a fresh connection. Also the batch statements'
    /// `statement_timeout`.
    #[arg(long, env = "OUTBOX_DATABASE_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(super) database_timeout: Duration,
    /// Largest payload published; bigger events are dead-lettered.
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES", default_value_t = outbox::DEFAULT_MAX_PAYLOAD_BYTES)]
    pub(super) max_payload_bytes: usize,
    /// Keep delivered events in `outbox_archive` instead of deleting them:
    /// partitioned by the day of publication, each day dropped whole once
    /// older than --archive-retention.
    #[arg(long, env = "OUTBOX_ARCHIVE")]
    pub(super) archive: bool,
    /// How long the archive keeps a day of published events (with
    /// --archive). Keep it at least as long as the consumers' inbox
    /// retention: the console's reconciliation reads both.
    #[arg(long, env = "OUTBOX_ARCHIVE_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    pub(super) archive_retention: Duration,
    /// On SIGTERM/SIGINT, how long to finish the batches in flight.
    #[arg(long, env = "OUTBOX_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(super) drain_timeout: Duration,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address.
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub(super) metrics_addr: Option<SocketAddr>,
    /// Lease time of ordered-event partitions: when a relay dies, the
    /// others take over its partitions after at most about this long (at
    /// once when it shuts down cleanly).
    #[arg(long, env = "OUTBOX_LEASE_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(super) lease_ttl: Duration,
    /// This relay's name in `status` (default `<hostname>-<pid>`).
    #[arg(long, env = "OUTBOX_RELAY_NAME")]
    pub(super) name: Option<String>,
    /// `wal` also publishes the events producers write to the write-ahead
    /// log (`outbox::Capture::Wal`), read from the replication slot the
    /// schema records (create it with `migrate --capture wal`). One
    /// relay reads the slot; others wait as standbys and take over when it
    /// stops. The outbox table is served either way. docs/WAL_CAPTURE.md.
    #[arg(long, env = "OUTBOX_CAPTURE", value_enum, default_value_t = CaptureArg::Table)]
    pub(super) capture: CaptureArg,
    /// With `--capture wal`: how long PostgreSQL waits for a silent reader
    /// (a frozen or cut-off relay) before it frees the slot for a standby.
    #[arg(long, env = "OUTBOX_WAL_SENDER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(super) wal_sender_timeout: Duration,
    /// A fleet: serve every schema of the database that holds the outbox
    /// at this release's migration (a schema per tenant), instead of
    /// --schema, found again every --discover-every: a tenant that is
    /// migrated joins, one dropped leaves, no restart. One pool of
    /// --workers + 2 connections and one LISTEN session per database, one
    /// broker connection, the workers taking turns over the tenants with
    /// work. Schemas behind or too new are reported (`status
    /// --all-schemas`), not served. The outbox tables only: not with
    /// --capture wal. Several fleets over a database where `migrate
    /// --fleet` ran split its tenants between them (without it each serves
    /// every tenant). docs/OPERATIONS.md, "Many tenants".
    #[arg(long, env = "OUTBOX_ALL_SCHEMAS")]
    pub(super) all_schemas: bool,
    /// With --all-schemas: only the schemas whose name is LIKE this
    /// pattern (`tenant_%`).
    #[arg(
        long,
        env = "OUTBOX_LIKE",
        value_name = "PATTERN",
        requires = "all_schemas"
    )]
    pub(super) like: Option<String>,
    /// With --all-schemas: more databases whose tenants the fleet serves
    /// beside DATABASE_URL's (repeat the flag, or separate the URLs with
    /// commas; a comma in a password as %2C). Never printed.
    #[arg(
        long,
        env = "OUTBOX_MORE_DATABASE_URLS",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "URL",
        requires = "all_schemas"
    )]
    pub(super) more_database_url: Vec<String>,
    /// With --all-schemas: how often each database is looked at again for
    /// tenants that joined or left. A migration also notifies the fleet
    /// (channel `outbox.schemas`): a tenant migrated is served at once.
    #[arg(long, env = "OUTBOX_DISCOVER_EVERY", default_value = "5s", value_parser = humantime::parse_duration, requires = "all_schemas")]
    pub(super) discover_every: Duration,
    /// With --all-schemas and --metrics-addr: how many tenants get series
    /// of their own in /metrics (`outbox_relay_tenant_*{database,
    /// schema}`): those with the oldest pending events, then the largest
    /// backlogs. The others are in the sums (`outbox_relay_backlog`, ...),
    /// so a thousand tenants do not make a thousand series. 0: none.
    #[arg(
        long,
        env = "OUTBOX_METRICS_TENANTS",
        value_name = "N",
        default_value_t = 10
    )]
    pub(super) metrics_tenants: usize,
}

/// `outbox-relay migrate`'s flags.
#[derive(Debug, ClapArgs)]
pub(super) struct MigrateArgs {
    /// `wal` also creates what the write-ahead-log capture reads
    /// (docs/WAL_CAPTURE.md): an empty publication and a logical
    /// replication slot of one name (see --slot), where missing, and
    /// records that name in the schema, where producers and relays
    /// find it. Needs wal_level = logical and a role with REPLICATION.
    /// From then on the slot keeps the WAL until a relay runs with
    /// `--capture wal`.
    #[arg(long, value_enum, default_value_t = CaptureArg::Table)]
    pub(super) capture: CaptureArg,
    /// With `--capture wal`: the slot's (and publication's) name.
    /// Default: the name the schema records, else `outbox_<schema>`.
    /// Slot names are cluster-wide: a second database with a schema
    /// of the same name needs another, e.g. `outbox_<database>_<schema>`.
    #[arg(long, value_name = "NAME")]
    pub(super) slot: Option<String>,
    /// Every schema of the database that already holds the outbox, at
    /// any version (`outbox-relay schemas` lists them): how a schema per
    /// tenant is upgraded after a release. --schema is then ignored.
    /// Each schema is reported on a line of its own; the exit status is
    /// 1 if any failed. A run cut short resumes where it stopped: each
    /// migration commits on its own.
    #[arg(long, conflicts_with_all = ["schemas_file", "slot"])]
    pub(super) all_schemas: bool,
    /// With --all-schemas: only the schemas whose name is LIKE this
    /// pattern (`tenant_%`).
    #[arg(long, value_name = "PATTERN", requires = "all_schemas")]
    pub(super) like: Option<String>,
    /// The schemas named in FILE, one per line (blank lines and lines
    /// starting with `#` skipped), created where missing: how new
    /// tenants are set up. --schema is then ignored; reported as with
    /// --all-schemas.
    #[arg(long, value_name = "FILE", conflicts_with = "slot")]
    pub(super) schemas_file: Option<std::path::PathBuf>,
    /// With --all-schemas or --schemas-file: how many schemas migrate
    /// at once, each on a connection of its own (schemas of one
    /// database migrate in parallel; one schema never twice at once).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(super) jobs: u16,
    /// Also create (or upgrade) the fleets' membership table, in schema
    /// `outbox_fleet`: fleets (`run --all-schemas`) over this database then
    /// split its tenants between them (a fleet that joins takes its share,
    /// one that stops or dies hands its tenants to the others) instead of
    /// each serving every tenant. The fleets' role needs SELECT, INSERT,
    /// UPDATE and DELETE on it. Alone, nothing else is migrated.
    #[arg(long, conflicts_with_all = ["slot", "capture"])]
    pub(super) fleet: bool,
}
