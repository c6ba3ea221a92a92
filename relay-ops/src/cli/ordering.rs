//! `outbox-relay ordering`: which aggregate types are ordered.

use anyhow::{Context, Result};
use outbox::Ident;
use sqlx::PgPool;

use super::args::OrderingCommand;

pub(super) async fn ordering(pool: &PgPool, schema: &Ident, cmd: &OrderingCommand) -> Result<()> {
    let (types, ordered) = match cmd {
        OrderingCommand::List => {
            let types = outbox::ordered_types(pool, schema.as_str()).await?;
            if types.is_empty() {
                say!("no ordered aggregate types");
            }
            for t in types {
                say!("{t}");
            }
            return Ok(());
        }
        OrderingCommand::Add { types } => (types, true),
        OrderingCommand::Remove { types } => (types, false),
    };
    for t in types {
        outbox::set_ordered(pool, schema.as_str(), t, ordered)
            .await
            .with_context(|| format!("changing the ordering of aggregate type {t:?}"))?;
        say!(
            "aggregate type {t:?} is {}ordered",
            if ordered { "" } else { "no longer " }
        );
    }
    Ok(())
}
