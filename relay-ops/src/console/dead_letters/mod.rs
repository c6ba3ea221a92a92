//! The Dead letters page: filter and page through them, read one in full,
//! and replay or purge one, the selected, or all matching a filter, each
//! after a confirmation that says how many events it will touch.
//!
//! The stages, a file each: `list.rs` (the page), `detail.rs` (one dead
//! letter), `request.rs` (an action form, read), `confirm.rs` (step one:
//! how many, and the form) and `act.rs` (step two: do it, audit it);
//! `filter.rs` is the filter both the list and the actions take.

mod act;
mod confirm;
mod detail;
mod filter;
mod list;
mod request;

pub(crate) use act::act;
pub(crate) use confirm::confirm;
pub(crate) use detail::detail;
pub(crate) use list::list;
