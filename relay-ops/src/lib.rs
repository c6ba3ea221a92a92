//! `outbox-relay`, the binary of the [outbox toolkit](https://github.com/outbox-rs/outbox),
//! and the operator tools beside the relay engine ([`outbox_relay`]):
//!
//! - [`admin`]: the operator's views and actions on one outbox schema
//!   (status, gauges, blocked aggregates and their skip, dead letters
//!   filtered, paged, replayed and purged, failures by class, what holds
//!   the xmin horizon, the WAL capture's slot), the same calls the
//!   subcommands and the console make;
//! - the command line ([`main`]): `run`, `migrate`, `status`,
//!   `dead-letters`, `blocked`, `ordering`, `console`, with `--help` text
//!   for every flag;
//! - the web console (`outbox-relay console`) and the relay's metrics and
//!   health endpoints.
//!
//! The crate uses the engine's public API only: what it does, a service
//! embedding [`outbox_relay::Relay`] can do too. The package is
//! `outbox-relay-ops` (its library `outbox_relay_ops`); the binary keeps
//! the name the docs and deployments use, `outbox-relay`.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use outbox::Ident;
//! let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/shop").await?;
//! let schema = Ident::new("schema", "public")?;
//! let status = outbox_relay_ops::admin::status(&pool, &schema).await?;
//! println!("{} waiting, {} dead", status.backlog, status.dead_letters);
//! # Ok(()) }
//! ```

pub mod admin;
mod cli;
mod console;
mod http;
mod secrets;

pub use crate::cli::main;
