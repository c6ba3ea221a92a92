//! The producer's migrations (the outbox, dead letters, idempotency keys,
//! ordering); the runner is `outbox_core::migrate`.

use outbox_core::migrate::{Migration, MigrationSet};

/// The producer's set: the outbox, dead letters and idempotency keys.
pub(crate) const PRODUCER: MigrationSet = MigrationSet {
    name: "producer",
    what: "the outbox",
    fix: "outbox-relay migrate",
    migrations: &[
        Migration {
            version: 1,
            name: "outbox",
            sql: include_str!("../migrations/0001_outbox.sql"),
        },
        Migration {
            version: 2,
            name: "idempotency_keys",
            sql: include_str!("../migrations/0002_idempotency_keys.sql"),
        },
        Migration {
            version: 3,
            name: "ordering",
            sql: include_str!("../migrations/0003_ordering.sql"),
        },
        Migration {
            version: 4,
            name: "publishable",
            sql: include_str!("../migrations/0004_publishable.sql"),
        },
        Migration {
            version: 5,
            name: "lease_renewal",
            sql: include_str!("../migrations/0005_lease_renewal.sql"),
        },
        Migration {
            version: 6,
            name: "ordered_types",
            sql: include_str!("../migrations/0006_ordered_types.sql"),
        },
        Migration {
            version: 7,
            name: "failed_ordered_idx",
            sql: include_str!("../migrations/0007_failed_ordered_idx.sql"),
        },
        Migration {
            version: 8,
            name: "relay_broker",
            sql: include_str!("../migrations/0008_relay_broker.sql"),
        },
        Migration {
            version: 9,
            name: "console",
            sql: include_str!("../migrations/0009_console.sql"),
        },
        Migration {
            version: 10,
            name: "wal_capture",
            sql: include_str!("../migrations/0010_wal_capture.sql"),
        },
        Migration {
            version: 11,
            name: "publishable_and_slot",
            sql: include_str!("../migrations/0011_publishable_and_slot.sql"),
        },
        Migration {
            version: 12,
            name: "dead_letter_groups",
            sql: include_str!("../migrations/0012_dead_letter_groups.sql"),
        },
        Migration {
            version: 13,
            name: "published_at_idx",
            sql: include_str!("../migrations/0013_published_at_idx.sql"),
        },
        Migration {
            version: 14,
            name: "publishable_fast",
            sql: include_str!("../migrations/0014_publishable_fast.sql"),
        },
        Migration {
            version: 15,
            name: "due_when_written",
            sql: include_str!("../migrations/0015_due_when_written.sql"),
        },
        Migration {
            version: 16,
            name: "archive_by_day",
            sql: include_str!("../migrations/0016_archive_by_day.sql"),
        },
        Migration {
            version: 17,
            name: "ordered_due_idx",
            sql: include_str!("../migrations/0017_ordered_due_idx.sql"),
        },
    ],
};
