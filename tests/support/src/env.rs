//! Where the test services are, and unique names for what a test creates.

/// PostgreSQL URL of the test database.
pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// RabbitMQ URL of the test broker.
pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The command line that runs `rabbitmqctl` against the test broker:
/// `TEST_RABBITMQCTL` split on spaces (`make test` names the standalone
/// node's for the alarm test), or `rabbitmqctl` (the default node).
pub fn rabbitmqctl() -> Vec<String> {
    let line = std::env::var("TEST_RABBITMQCTL").unwrap_or_default();
    let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    if words.is_empty() {
        vec!["rabbitmqctl".to_owned()]
    } else {
        words
    }
}

/// A short random suffix for names.
pub fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}
