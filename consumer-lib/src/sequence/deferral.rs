//! Why a sequenced event was deferred, and the reasons logged and given
//! to the dead-letter queue.

/// Why a sequenced event was deferred: sent back through the retry queue
/// (header `x-deferral-count`), not counted against the handler's retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Deferral {
    /// The next sequence number its aggregate expects.
    pub(crate) expected: i64,
    /// The event's own sequence number.
    pub(crate) got: i64,
    /// Held back behind a failed earlier event of its aggregate in the
    /// batch, rather than a gap.
    pub(crate) held_back: bool,
}

impl Deferral {
    /// Why this event is deferred (logged).
    pub(crate) fn reason(&self) -> String {
        let Self { expected, got, .. } = self;
        if self.held_back {
            format!(
                "held back: an earlier event of this aggregate was not applied (expected {expected}, got {got})"
            )
        } else {
            format!("sequence gap: expected {expected}, got {got}")
        }
    }

    /// The dead-letter reason once `max_deferrals` are spent.
    pub(crate) fn give_up_reason(&self, max_deferrals: u32) -> String {
        let Self { expected, got, .. } = self;
        let why = if self.held_back {
            " (held back behind a failed earlier event of this aggregate)"
        } else {
            ""
        };
        format!(
            "sequence gap never closed after {max_deferrals} deferrals: expected {expected}, got {got}{why}"
        )
    }
}
