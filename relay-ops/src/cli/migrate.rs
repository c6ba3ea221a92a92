//! `outbox-relay migrate`: the outbox tables, and with `--capture wal` what
//! the write-ahead-log capture reads.

use anyhow::{Context, Result, bail};
use outbox::Ident;
use sqlx::PgPool;

use super::args::CaptureArg;

pub(super) async fn migrate(
    pool: &PgPool,
    schema: &Ident,
    capture: CaptureArg,
    slot: Option<&str>,
) -> Result<()> {
    if slot.is_some() && capture != CaptureArg::Wal {
        bail!("--slot names the write-ahead-log capture's slot: give it with --capture wal");
    }
    let applied = outbox::migrate(pool, schema.as_str())
        .await
        .context("migration failed")?;
    if applied.is_empty() {
        say!("schema {schema} is up to date");
    } else {
        say!("schema {schema}: applied migrations {applied:?}");
    }
    if capture == CaptureArg::Wal {
        let done = outbox_relay::create_wal_slot(pool, schema, slot)
            .await
            .context("setting up the write-ahead-log capture")?;
        let slot = &done.slot;
        say!(
            "publication {slot} {}; replication slot {slot} {}",
            created_or_exists(done.publication_created),
            created_or_exists(done.slot_created)
        );
    }
    Ok(())
}

fn created_or_exists(created: bool) -> &'static str {
    if created { "created" } else { "exists" }
}
