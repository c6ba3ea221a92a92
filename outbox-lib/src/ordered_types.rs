//! Which aggregate types are ordered: a property of the data, kept in
//! `<schema>.outbox_ordered_types` and enforced by the database for every
//! writer ([`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md)).
//!
//! Below the producer's handle: `outbox/` reads [`OrderedAggregates`] and
//! calls `ensure` at start-up; nothing here knows the handle.

use std::collections::BTreeSet;

use outbox_core::sql::render;
use sqlx::PgPool;

use crate::error::{Error, Result};
use outbox_core::Ident;

/// The name that orders every aggregate type.
pub const ALL_TYPES: &str = "*";

/// Which events are published in per-aggregate commit order
/// ([`docs/ORDERING.md`](https://github.com/outbox-rs/outbox/blob/main/docs/ORDERING.md)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderedAggregates {
    /// No ordering (default): events are published as soon as possible, in
    /// any order, by any relay worker.
    #[default]
    None,
    /// Every event is ordered within its aggregate.
    All,
    /// Events of these aggregate types are ordered; the rest are not.
    Types(BTreeSet<String>),
}

impl OrderedAggregates {
    /// Ordering for the named aggregate types only.
    pub fn types<I, S>(types: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::Types(types.into_iter().map(Into::into).collect())
    }

    /// Whether events of `aggregate_type` are ordered.
    pub fn applies_to(&self, aggregate_type: &str) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Types(t) => t.contains(aggregate_type),
        }
    }
}

/// Makes events of `aggregate_type` (or of every type, with
/// [`ALL_TYPES`]) ordered, or no longer ordered, for every writer of the
/// outbox in `schema`: from the next insert on, whoever inserts (this
/// library, SQL, another language), each event of an ordered type takes
/// the next number of its aggregate. Needs the rights of the schema's
/// owner (the database may create or drop a trigger); `outbox-relay
/// ordering add|remove` does the same from the command line.
///
/// Stopping ordering does not renumber anything: events already numbered
/// stay ordered until published.
pub async fn set_ordered(
    pool: &PgPool,
    schema: &str,
    aggregate_type: &str,
    ordered: bool,
) -> Result<()> {
    let schema = Ident::new("schema", schema)?;
    if aggregate_type.trim().is_empty() {
        return Err(Error::EmptyField {
            field: "aggregate_type",
        });
    }
    sqlx::query(render(
        "SELECT {schema}.outbox_set_ordered($1, $2)",
        &schema,
    ))
    .bind(aggregate_type)
    .bind(ordered)
    .execute(pool)
    .await?;
    Ok(())
}

/// The ordered aggregate types of the outbox in `schema`, sorted
/// ([`ALL_TYPES`] when every type is).
pub async fn ordered_types(pool: &PgPool, schema: &str) -> Result<Vec<String>> {
    let schema = Ident::new("schema", schema)?;
    Ok(sqlx::query_scalar(render(
        "SELECT aggregate_type FROM {schema}.outbox_ordered_types ORDER BY 1",
        &schema,
    ))
    .fetch_all(pool)
    .await?)
}

/// Checks that the database orders what `ordering` names; a handle never
/// registers types itself (the DDL would run at application start, and a
/// producer of the previous version still running would number its events
/// a second time): ordering a type is an operator's step, once every
/// producer runs this version.
pub(crate) async fn ensure(
    pool: &PgPool,
    schema: &Ident,
    ordering: &OrderedAggregates,
) -> Result<()> {
    let wanted: Vec<String> = match ordering {
        OrderedAggregates::None => return Ok(()),
        OrderedAggregates::All => vec![ALL_TYPES.to_owned()],
        OrderedAggregates::Types(t) => t.iter().cloned().collect(),
    };
    let have = ordered_types(pool, schema.as_str()).await?;
    if have.iter().any(|t| t == ALL_TYPES) {
        return Ok(());
    }
    match wanted.into_iter().find(|t| !have.contains(t)) {
        Some(aggregate_type) => Err(Error::OrderingNotRegistered {
            aggregate_type,
            schema: schema.to_string(),
        }),
        None => Ok(()),
    }
}
