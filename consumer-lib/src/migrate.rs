use outbox_core::migrate::{Migration, MigrationSet};

/// The consumer's migration set: the inbox, version and sequence records.
pub(crate) const CONSUMER: MigrationSet = MigrationSet {
    name: "consumer",
    what: "the inbox",
    fix: "outbox_consumer::migrate(&pool, schema)",
    migrations: &[
        Migration {
            version: 1,
            name: "inbox",
            sql: include_str!("../migrations/0001_inbox.sql"),
        },
        Migration {
            version: 2,
            name: "inbox_sequences",
            sql: include_str!("../migrations/0002_inbox_sequences.sql"),
        },
        Migration {
            version: 3,
            name: "inbox_by_time",
            sql: include_str!("../migrations/0003_inbox_by_time.sql"),
        },
    ],
};
