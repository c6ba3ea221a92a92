use outbox::__private::{Migration, MigrationSet};

/// The consumer's migration set: the inbox and version records.
pub(crate) const CONSUMER: MigrationSet = MigrationSet {
    name: "consumer",
    what: "the inbox",
    fix: "outbox_consumer::migrate(&pool, schema)",
    migrations: &[Migration {
        version: 1,
        name: "inbox",
        sql: include_str!("../../migrations/consumer/0001_inbox.sql"),
    }],
};
