//! Ordered consumption: each sequenced event's position in its aggregate,
//! the `inbox_sequences` statements, and the classification of a batch's
//! sequenced events against the last applied sequence numbers.
//!
//! By concept: `position.rs` (where an event stands, read from its
//! headers), `sequencer.rs` (each event's [`Turn`], a pure planner over the
//! locked rows), `statements.rs` (the `inbox_sequences` statements that
//! lock and advance those rows) and `deferral.rs` (why an event not yet
//! applicable goes back through the retry queue).

mod deferral;
mod position;
mod sequencer;
mod statements;
#[cfg(test)]
mod tests;

pub(crate) use self::deferral::Deferral;
pub(crate) use self::position::{Position, position};
pub(crate) use self::sequencer::{Sequencer, Turn};
pub(crate) use self::statements::Sequences;
