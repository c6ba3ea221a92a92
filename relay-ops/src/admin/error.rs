//! What an operator view or action can fail with.

use thiserror::Error;

/// Errors of the operator views and actions.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// An operator action found more dead letters than the operator
    /// confirmed (more arrived or came to match since): it changed nothing.
    #[error(
        "{found} dead letters match now, more than the {confirmed} confirmed: nothing was changed; look again and confirm the new count"
    )]
    SelectionGrew {
        /// How many the operator confirmed.
        confirmed: u64,
        /// How many the action found.
        found: u64,
    },
}

/// The result type of the operator views and actions.
pub type Result<T, E = Error> = std::result::Result<T, E>;
