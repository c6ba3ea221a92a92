//! Operator views and actions, one file per subject: `status.rs` (the
//! backlog at a glance, the gauges, the relays), `blocked.rs` (ordered
//! aggregates held up by a failing head), `dead_letters.rs` and
//! `dead_letter_pages.rs` (filter, page, read, replay, purge),
//! `backlog.rs` (the oldest due events, the backlog per type, the publish
//! rate), `failures.rs` (dead letters grouped by error class, event type
//! and exchange), `horizon.rs` (what holds the xmin horizon back),
//! `wal.rs` (the capture's slot) and `estimate.rs` (how a count too
//! costly to make is estimated). A statement longer than a line is a
//! `.sql` file in the folder named after its module (`status/`,
//! `blocked/`, ...); each is rendered by `outbox_core::sql`. The `outbox-relay`
//! subcommands of the same names and the console (`outbox-relay console`)
//! call these; they fail with their own [`Error`].

mod backlog;
mod blocked;
mod dead_letter_pages;
mod dead_letters;
mod error;
mod estimate;
mod failures;
mod horizon;
mod status;
mod wal;

pub use backlog::{
    BacklogByType, MinuteRate, PendingEvent, TypeBacklog, backlog_by_type, oldest_due,
    publish_rates,
};
pub use blocked::{
    BlockedAggregate, WAITING_COUNTED_UP_TO, WaitingEvent, blocked_aggregates, retry_now,
    skip_events, waiting_events,
};
pub use dead_letter_pages::{
    Cursor, DeadLetterPage, Order, PageAt, list_dead_letters, page_dead_letters,
    sample_dead_letters,
};
pub use dead_letters::{
    DeadLetter, DeadLetterDetail, Filter, Replayed, Selection, count_dead_letters, dead_letter,
    estimate_dead_letters, purge_dead_letters, replay_dead_letters,
};
pub use error::{Error, Result};
pub use failures::{Breakdown, Exchange, FailureGroup, Failures, OtherGroups, failures, share};
pub use horizon::{HORIZON_NOTEWORTHY_S, Horizon, HorizonHolder, horizon};
pub use status::{
    EXACT_COUNT_UP_TO, FailingEvent, Gauges, RelayLeases, Status, gauges, relays, status,
};
pub use wal::{WalSlot, wal_slot};
