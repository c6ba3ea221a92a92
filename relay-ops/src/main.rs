//! `outbox-relay`: publishes the transactional outbox to RabbitMQ, and the
//! operator's commands. The command line is `outbox_relay_ops::main`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_relay_ops::main().await
}
