//! Operator views and actions, one file per subject: [`status`](mod@status) (the
//! backlog at a glance, the gauges, the relays), [`blocked`] (ordered
//! aggregates held up by a failing head), [`dead_letters`] (filter, page,
//! read, replay, purge) and [`backlog`] (the oldest due events, the backlog
//! per type, the publish rate) and [`failures`](mod@failures) (dead letters grouped by
//! error class, event type and exchange). The `outbox-relay` subcommands
//! of the same names and the console (`outbox-relay console`) call these.

pub mod backlog;
pub mod blocked;
pub mod dead_letter_pages;
pub mod dead_letters;
pub mod failures;
pub mod status;
pub mod wal;

pub use backlog::{
    BacklogByType, MinuteRate, PendingEvent, TypeBacklog, backlog_by_type, oldest_due,
    publish_rates,
};
pub use blocked::{
    BlockedAggregate, WaitingEvent, blocked_aggregates, retry_now, skip_events, waiting_events,
};
pub use dead_letter_pages::{
    Cursor, DeadLetterPage, Order, PageAt, list_dead_letters, page_dead_letters,
    sample_dead_letters,
};
pub use dead_letters::{
    DeadLetter, DeadLetterDetail, Filter, Replayed, Selection, count_dead_letters, dead_letter,
    estimate_dead_letters, purge_dead_letters, replay_dead_letters,
};
pub use failures::{Breakdown, Exchange, FailureGroup, Failures, OtherGroups, failures};
pub use status::{FailingEvent, Gauges, RelayLeases, Status, gauges, relays, status};
pub use wal::{WalSetUp, WalSlot, create_wal_slot, drop_wal_slot, recorded_wal_slot, wal_slot};
