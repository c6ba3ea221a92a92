//! The write-ahead-log capture ([`docs/WAL_CAPTURE.md`](https://github.com/outbox-rs/outbox/blob/main/docs/WAL_CAPTURE.md)):
//! one reader per slot streams the transactional messages `outbox_emit`
//! wrote, in commit order, publishes them with the relay's publisher
//! (confirms, mandatory returns), puts those not delivered in the outbox
//! table (`divert.rs`), and only then confirms their position to the slot.
//! The files: `reader.rs` (sessions, standby, reconnects), `config.rs`
//! (what it takes of the relay's configuration), `slot.rs`,
//! `stream.rs` (reading and sending), `window.rs` (the batches on the
//! wire), `decode.rs`, and `setup.rs` (creating and dropping the slot).
//! Other relays wait as standbys and take the slot when it is free.

mod config;
mod decode;
pub(crate) mod divert;
mod reader;
mod setup;
mod slot;
mod stream;
mod window;

pub(crate) use config::ReaderConfig;
pub(crate) use reader::WalReader;
pub use setup::recorded_wal_slot;
pub use setup::{WalSetUp, create_wal_slot, drop_wal_slot};
pub(crate) use slot::{lost_message, refusal, slot_row};

use pgwire_replication::ReplicationConfig;

/// Where the replication connection goes, read from a PostgreSQL URL; or
/// why it cannot be used (never quoting the URL).
pub(crate) fn source(url: &str) -> Result<ReplicationConfig, String> {
    let what = "WAL capture database URL";
    outbox::urls::check_url(url, what, &["postgres", "postgresql"])?;
    let u = url::Url::parse(url).map_err(|_| {
        format!("{what} is malformed; the value is not shown: it may hold a password")
    })?;
    let decode =
        |s: &str| percent_decode(s).ok_or_else(|| format!("{what} has a malformed percent-escape"));
    let mut host = decode(u.host_str().unwrap_or(""))?;
    let mut port = u.port().unwrap_or(5432);
    let mut user = decode(u.username())?;
    let mut password = decode(u.password().unwrap_or(""))?;
    let mut database = decode(u.path().trim_start_matches('/'))?;
    for (k, v) in u.query_pairs() {
        match &*k {
            "host" => host = v.into_owned(),
            "port" => {
                port = v
                    .parse()
                    .map_err(|_| format!("{what}: port {v:?} is not a number"))?
            }
            "user" => user = v.into_owned(),
            "password" => password = v.into_owned(),
            "dbname" => database = v.into_owned(),
            "sslmode" if matches!(&*v, "require" | "verify-ca" | "verify-full") => {
                return Err(format!(
                    "{what}: sslmode={v} is not supported on the replication connection yet; use a loopback or private address or a Unix socket, with sslmode=disable or prefer"
                ));
            }
            _ => {}
        }
    }
    if host.is_empty() {
        host = "localhost".to_owned();
    }
    if user.is_empty() {
        user = "postgres".to_owned();
    }
    if database.is_empty() {
        database = user.clone();
    }
    let mut cfg = ReplicationConfig::new(host, user, password, database, "", "");
    cfg.port = port;
    Ok(cfg)
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_replication_connections() {
        let c = source("postgres://relay:p%40ss@db.internal:6543/shop?application_name=x").unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str(),
                c.database.as_str()
            ),
            ("db.internal", 6543, "relay", "p@ss", "shop")
        );
        let c = source("postgresql://app@%2Fvar%2Frun%2Fpostgresql/orders").unwrap();
        assert_eq!(c.host, "/var/run/postgresql");
        assert!(c.is_unix_socket());
        let c = source("postgres:///shop?host=/tmp&user=u&port=5433").unwrap();
        assert_eq!(
            (c.host.as_str(), c.user.as_str(), c.port),
            ("/tmp", "u", 5433)
        );
    }

    #[test]
    fn bad_urls_are_refused_without_their_password() {
        for (url, needle) in [
            ("mysql://u:hunter2@h/db", "postgres://"),
            (
                "postgres://u:hunter2@h/db?sslmode=require",
                "sslmode=require",
            ),
            ("postgres://u:hunter2@h/db?port=x", "not a number"),
        ] {
            let err = source(url).unwrap_err();
            assert!(err.contains(needle), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }
}
