//! Test support: real PostgreSQL and RabbitMQ, one schema and one set of
//! exchange and queue names per test, and waits on conditions with
//! deadlines (never sleep-and-hope).

pub mod browser;
pub mod cluster;
pub mod console;
pub mod consumer;
pub mod service;

pub use service::free_port;
pub mod wal;

mod assert;
mod broker;
mod collect;
mod database;
mod db;
mod effect;
mod env;
mod http;
mod process;
mod proxy;
mod relay;
mod wait;

pub use assert::{assert_applied_once, assert_contract};
pub use broker::{TestBroker, connect, connect_any, declare_tap_queue, depth, settled_depth};
pub use collect::{Collector, Received, SeqLog};
pub use database::TestDatabase;
pub use db::{TestDb, drop_orphan_slots, drop_slot, hold_snapshot, locked_rows, pool, scans};
pub use effect::RecordEffect;
pub use env::{amqp_url, database_url, rabbitmqctl, suffix};
pub use http::{HttpReply, http_get, post_json};
pub use process::{
    KillOnDrop, ProcessLogs, freeze_mid_batch, kill_now, output, relay_command, stop_child,
    wait_exit, wait_for_port,
};
pub use proxy::{Mode, Proxy};
pub use relay::{RunningRelay, TestRelay};
pub use wait::{wait_until, wait_until_every};
