//! `outbox-relay`: publishes the transactional outbox to RabbitMQ. The
//! command line is the library's `cli` module (feature `cli`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_relay::cli::main().await
}
