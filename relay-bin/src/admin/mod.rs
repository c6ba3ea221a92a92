//! Operator views and actions, one file per subject: [`status`](mod@status) (the
//! backlog at a glance, the gauges), [`blocked`] (ordered aggregates held
//! up by a failing head) and [`dead_letters`] (list, replay, purge). The
//! `outbox-relay` subcommands of the same names call these.

pub mod blocked;
pub mod dead_letters;
pub mod status;

pub use blocked::{BlockedAggregate, blocked_aggregates, retry_now, skip_events};
pub use dead_letters::{
    DeadLetter, Replayed, Selection, list_dead_letters, purge_dead_letters, replay_dead_letters,
};
pub use status::{FailingEvent, Gauges, RelayLeases, Status, gauges, status};
