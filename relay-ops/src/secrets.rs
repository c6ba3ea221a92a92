//! The passwords the process knows of, kept out of what it prints: the
//! command line's last error and every error the console shows or logs.

use outbox::redact::scrub;

/// Strips passwords of the URLs in the environment from `text`.
pub(crate) fn scrub_secrets(text: &str) -> String {
    ["DATABASE_URL", "AMQP_URL", "OUTBOX_MORE_DATABASE_URLS"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .fold(text.to_owned(), |t, url| scrub(&t, &url))
}
