//! The `outbox-relay` binary: flags and environment → one
//! validated config → the command. Not an API: `main.rs` calls [`main`].
//!
//! One file per subcommand; `args.rs` holds every flag (their doc comments
//! are the `--help` text), and `database.rs` the connection the commands
//! share.

use std::process::ExitCode;

use anyhow::{Result, bail};
use outbox::Ident;
use outbox::redact::scrub;
use tokio_util::sync::CancellationToken;

/// `println!` that treats a closed pipe as success and other errors as errors.
macro_rules! say {
    ($($t:tt)*) => { $crate::cli::emit(&format!("{}\n", format_args!($($t)*)))? };
}

mod args;
mod blocked;
mod console;
mod database;
mod dead_letters;
mod logging;
mod migrate;
mod ordering;
mod run;
mod status;

use args::{Args, Command};
use clap::Parser;
use logging::init_logging;

/// The `outbox-relay` binary: parses the command line, sets up logging and
/// runs the command. Its error is printed on one line, secrets scrubbed.
pub async fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            // One line naming the cause; never a password.
            let line = crate::secrets::scrub_secrets(&format!("{e:#}"));
            eprintln!("outbox-relay: error: {line}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<ExitCode> {
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

/// The command's other URLs (brokers, a fleet's more databases): scrubbed
/// from its errors too.
fn amqp_url(args: &Args) -> String {
    match &args.command {
        Command::Run(r) => [r.amqp_url.as_slice(), r.more_database_url.as_slice()]
            .concat()
            .join(","),
        Command::Console(c) => c.amqp_url.join(","),
        _ => String::new(),
    }
}

async fn dispatch(args: &Args, url: &str, schema: &Ident) -> Result<ExitCode> {
    // The relay opens pools of its own (a fleet's, one per database).
    if let Command::Run(r) = &args.command {
        return if r.all_schemas {
            run::run_fleet(url, r, args.slow_statement).await
        } else {
            run::run_relay(url, schema, r, args.slow_statement).await
        };
    }
    // Many schemas migrate on a connection each.
    let size = match &args.command {
        Command::Migrate(m) => 8.max(u32::from(m.jobs) + 1),
        _ => 8,
    };
    let pool =
        database::connect_db(url, size, args.slow_statement, database::DATABASE_TIMEOUT).await?;
    match &args.command {
        Command::Migrate(m) => return migrate::migrate(&pool, schema, m).await,
        Command::Schemas { like, json } => migrate::schemas(&pool, like.as_deref(), *json).await?,
        Command::Status {
            json,
            all_schemas: true,
            like,
            worst,
        } => status::status_many(&pool, like.as_deref(), *worst, *json).await?,
        Command::Status { json, .. } => status::status(&pool, schema, *json).await?,
        Command::DeadLetters(cmd) => dead_letters::dead_letters(&pool, schema, cmd).await?,
        Command::Blocked(cmd) => blocked::blocked(&pool, schema, cmd).await?,
        Command::Ordering(cmd) => ordering::ordering(&pool, schema, cmd).await?,
        // Dispatched above, before this pool.
        Command::Run(_) => {}
        Command::Console(c) => console::console(pool, schema, url, c).await?,
    }
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
