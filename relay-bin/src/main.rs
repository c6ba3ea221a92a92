//! `outbox-relay`: publishes the transactional outbox to RabbitMQ.

mod cli;
mod console;
mod http;
mod secrets;

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let args = cli::Args::parse();
    cli::init_logging(args.log_format);
    match cli::run(args).await {
        Ok(code) => code,
        Err(e) => {
            // One line naming the cause; never a password.
            let line = secrets::scrub_secrets(&format!("{e:#}"));
            eprintln!("outbox-relay: error: {line}");
            ExitCode::FAILURE
        }
    }
}
