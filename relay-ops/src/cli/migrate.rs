//! `outbox-relay migrate`: the outbox tables of one schema, and with
//! `--capture wal` what the write-ahead-log capture reads; or the tables of
//! many schemas at once (`--all-schemas`, `--schemas-file`). And
//! `outbox-relay schemas`: where every schema's migrations stand.

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use outbox::{Ident, SchemaState};
use sqlx::PgPool;

use super::args::{CaptureArg, MigrateArgs};

pub(super) async fn migrate(pool: &PgPool, schema: &Ident, args: &MigrateArgs) -> Result<ExitCode> {
    let many = args.all_schemas || args.schemas_file.is_some();
    if args.fleet {
        let applied = outbox_relay::migrate_fleet(pool)
            .await
            .context("creating the fleets' membership table")?;
        let fleet = outbox_relay::FLEET_SCHEMA;
        if applied.is_empty() {
            say!("{fleet} (the fleets' membership) is up to date");
        } else {
            say!("{fleet} (the fleets' membership): applied migrations {applied:?}");
        }
        if !many {
            return Ok(ExitCode::SUCCESS);
        }
    }
    if many {
        return migrate_many(pool, args).await;
    }
    let capture = args.capture;
    let slot = args.slot.as_deref();
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
    Ok(ExitCode::SUCCESS)
}

/// `--all-schemas` or `--schemas-file`: each schema migrated on its own
/// connection, `--jobs` at once, reported on a line of its own as it
/// ends; a schema that fails stops no other.
async fn migrate_many(pool: &PgPool, args: &MigrateArgs) -> Result<ExitCode> {
    if args.capture == CaptureArg::Wal {
        bail!(
            "--capture wal sets up one schema's replication slot at a time (slots are few: max_replication_slots): run it with --schema for each schema that captures from the log"
        );
    }
    let schemas = match &args.schemas_file {
        Some(file) => schemas_in(file)?,
        None => outbox::census(pool, args.like.as_deref())
            .await
            .context("listing the schemas that hold the outbox")?
            .into_iter()
            .map(|s| s.schema)
            .collect(),
    };
    if schemas.is_empty() {
        say!("no schema to migrate");
        return Ok(ExitCode::SUCCESS);
    }
    let total = schemas.len();
    let mut runs = futures_util::stream::iter(schemas)
        .map(|schema| async move {
            let r = outbox::migrate(pool, &schema).await;
            (schema, r)
        })
        .buffer_unordered(usize::from(args.jobs));
    let (mut upgraded, mut failed) = (0, Vec::new());
    while let Some((schema, r)) = runs.next().await {
        match r {
            Ok(applied) if applied.is_empty() => say!("{schema}: up to date"),
            Ok(applied) => {
                upgraded += 1;
                say!("{schema}: applied migrations {applied:?}");
            }
            Err(e) => {
                say!("{schema}: failed: {e}");
                failed.push(schema);
            }
        }
    }
    say!(
        "{total} schemas: {upgraded} migrated, {} up to date, {} failed",
        total - upgraded - failed.len(),
        failed.len()
    );
    if failed.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    failed.sort();
    bail!(
        "{} of {total} schemas failed to migrate ({}); the others are done, and a run again resumes where each stopped",
        failed.len(),
        failed.join(", ")
    )
}

/// The schema names in `file`, one per line, checked before any is
/// migrated (a typo fails the run before it starts).
fn schemas_in(file: &std::path::Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read --schemas-file {}", file.display()))?;
    let mut names = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name = Ident::new("schema", line)
            .with_context(|| format!("{}, line {}", file.display(), n + 1))?;
        if !names.contains(&name) {
            names.push(name);
        }
    }
    Ok(names.into_iter().map(|n| n.as_str().to_owned()).collect())
}

/// `outbox-relay schemas`: every schema holding the outbox and where its
/// migrations stand.
pub(super) async fn schemas(pool: &PgPool, like: Option<&str>, json: bool) -> Result<()> {
    let found = outbox::census(pool, like)
        .await
        .context("listing the schemas that hold the outbox")?;
    if json {
        let rows: Vec<_> = found
            .iter()
            .map(|s| {
                let (state, version) = match s.state {
                    SchemaState::Current(v) => ("current", Some(v)),
                    SchemaState::Behind { found, .. } => ("behind", Some(found)),
                    SchemaState::TooNew { found, .. } => ("too_new", Some(found)),
                    _ => ("unreadable", None),
                };
                serde_json::json!({"schema": s.schema, "state": state, "version": version})
            })
            .collect();
        say!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    if found.is_empty() {
        say!("no schema holds the outbox");
    }
    let width = found.iter().map(|s| s.schema.len()).max().unwrap_or(0);
    for s in &found {
        say!("{:width$}  {}", s.schema, s.state);
    }
    Ok(())
}

fn created_or_exists(created: bool) -> &'static str {
    if created { "created" } else { "exists" }
}
