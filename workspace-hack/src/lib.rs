//! Feature unification only: see `Cargo.toml`.
