//! The dead-letter table: list, filter and page, read one, replay into the
//! outbox, purge (`outbox-relay dead-letters` and the console).
//!
//! Every filter is served by an index (migration 9: event type; aggregate
//! type and id; the time of dead-lettering; migration 12: the error's class,
//! the exchange, the stored words and word pairs of the error), so a page
//! costs its rows on any size of table.

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::{Template, render};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::Result;
use super::estimate::sample_percent;
use super::failures::Exchange;

/// A dead-lettered event.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Event id.
    pub id: Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made.
    pub attempts: i32,
    /// Why it was dead-lettered.
    pub last_error: String,
    /// When the event was created.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
    /// Exchange (`None`: the relay's default).
    pub exchange: Option<String>,
    /// Routing key (`None`: `<aggregate_type>.<event_type>`).
    pub routing_key: Option<String>,
}

/// A dead letter in full: [`DeadLetter`] and what it carried.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct DeadLetterDetail {
    /// The fields the list shows.
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub summary: DeadLetter,
    /// The event's payload.
    pub payload: serde_json::Value,
    /// Its headers (a JSON object).
    pub headers: serde_json::Value,
    /// Its number in its aggregate, when ordered.
    pub aggregate_seq: Option<i64>,
    /// Earlier failures, oldest first: a JSON array of `{at, error}`.
    pub error_history: serde_json::Value,
}

/// Which dead letters to list or act on: every set field must match; an
/// empty filter matches all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Filter {
    /// Event type, exactly.
    pub event_type: Option<String>,
    /// Aggregate type, exactly.
    pub aggregate_type: Option<String>,
    /// Aggregate id, exactly.
    pub aggregate_id: Option<String>,
    /// Words the last error contains, in this order: whole words,
    /// case-insensitive (`no route`, `PRECONDITION_FAILED`, `timeout`).
    /// A full-text match (PostgreSQL's `simple` configuration), served by an
    /// index: `NO_ROUTE` finds `NO_ROUTE: no queue bound`, `ROUT` does not.
    pub error_words: Option<String>,
    /// Error class, exactly: the last error with ids, quoted values, hex
    /// strings and numbers normalised away, as
    /// [`failures`](crate::admin::failures()) groups them.
    pub error_class: Option<String>,
    /// The exchange it was published to ([`Exchange::RelayDefault`]: the
    /// relay's default, a NULL `exchange`).
    pub exchange: Option<Exchange>,
    /// Dead-lettered at or after this instant.
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before this instant.
    pub until: Option<DateTime<Utc>>,
}

impl Filter {
    /// No field set: matches every dead letter.
    pub fn is_empty(&self) -> bool {
        *self == Filter::default()
    }

    /// Appends ` AND <condition>` per set field, on the table alias `d`.
    pub(crate) fn push_conditions(&self, q: &mut QueryBuilder<Postgres>) {
        let exact = [
            ("d.event_type", &self.event_type),
            ("d.aggregate_type", &self.aggregate_type),
            ("d.aggregate_id", &self.aggregate_id),
            ("d.error_class", &self.error_class),
        ];
        for (column, value) in exact {
            if let Some(v) = value {
                q.push(" AND ")
                    .push(column)
                    .push(" = ")
                    .push_bind(v.clone());
            }
        }
        if let Some(words) = &self.error_words {
            push_phrase(q, words);
        }
        match &self.exchange {
            Some(Exchange::RelayDefault) => {
                q.push(" AND d.exchange IS NULL");
            }
            Some(Exchange::Named(name)) => {
                q.push(" AND d.exchange = ").push_bind(name.clone());
            }
            None => {}
        }
        if let Some(t) = self.since {
            q.push(" AND d.dead_lettered_at >= ").push_bind(t);
        }
        if let Some(t) = self.until {
            q.push(" AND d.dead_lettered_at < ").push_bind(t);
        }
    }
}

/// ` AND d.error_words @@ <its pairs> AND <the phrase>`: the phrase's pairs
/// of adjacent words, which the GIN index finds exactly (migration 12
/// stores each pair as one more lexeme; a one-word phrase is the word),
/// then the phrase itself, in order, on those rows only: `ts_match_vq` is
/// `@@` the index cannot take, so the index scan does not also walk the
/// single words' long posting lists (every row holding "the").
pub(crate) fn push_phrase(q: &mut QueryBuilder<Postgres>, words: &str) {
    const LEXEMES: &str =
        "SELECT lexeme, unnest(positions) AS pos FROM unnest(to_tsvector('simple', ";
    q.push(
        r#" AND d.error_words @@ coalesce(
            (SELECT string_agg('''' || replace(replace(a.lexeme || ' ' || b.lexeme, '\', '\\'), '''', '\''') || '''', ' & ')::tsquery
             FROM ("#,
    )
    .push(LEXEMES)
    .push_bind(words.to_owned())
    .push("))) a JOIN (")
    .push(LEXEMES)
    .push_bind(words.to_owned())
    .push("))) b ON b.pos = a.pos + 1), phraseto_tsquery('simple', ")
    .push_bind(words.to_owned())
    .push(")) AND ts_match_vq(d.error_words, phraseto_tsquery('simple', ")
    .push_bind(words.to_owned())
    .push("))");
}

/// Which dead letters an action applies to.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Selection {
    /// Every dead letter.
    All,
    /// These ids.
    Ids(Vec<Uuid>),
    /// Those matching a filter (give it an `until` to leave out dead letters
    /// that arrive after the operator confirmed).
    Matching(Filter),
}

impl Selection {
    /// Appends ` AND <condition>` selecting these dead letters (alias `d`).
    pub(crate) fn push_conditions(&self, q: &mut QueryBuilder<Postgres>) {
        match self {
            Selection::All => {}
            Selection::Ids(ids) => {
                q.push(" AND d.id = ANY(").push_bind(ids.clone()).push(")");
            }
            Selection::Matching(filter) => filter.push_conditions(q),
        }
    }
}

/// How many dead letters `selection` holds, counting at most `cap` of
/// them when given (the answer is then `min(selected, cap)`).
pub async fn count_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    cap: Option<i64>,
) -> Result<i64> {
    // Error words: the matches through the GIN index, fenced (`OFFSET 0`),
    // or the planner may scan the whole table for a cap it thinks near.
    let words = matches!(selection, Selection::Matching(f) if f.error_words.is_some());
    let seed = if words {
        "SELECT count(*) FROM (SELECT 1 FROM (SELECT d.id FROM {schema}.outbox_dead_letters d \
         WHERE TRUE"
    } else {
        "SELECT count(*) FROM (SELECT 1 FROM {schema}.outbox_dead_letters d WHERE TRUE"
    };
    let mut q = QueryBuilder::new(render(seed, schema).as_str());
    selection.push_conditions(&mut q);
    if words {
        q.push(" OFFSET 0) d");
    }
    if let Some(cap) = cap {
        q.push(" LIMIT ").push_bind(cap);
    }
    q.push(") AS m");
    Ok(q.build_query_scalar().fetch_one(pool).await?)
}

/// About how many dead letters `selection` holds, without reading them
/// all: the matches in a sample of about 800 of the table's pages
/// (`TABLESAMPLE SYSTEM`, the estimates' one sampling policy:
/// `estimate.rs`), scaled up; exact on a table that small. For a
/// selection too large to count while a page waits.
pub async fn estimate_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
) -> Result<i64> {
    let seed = Template::new(include_str!("dead_letters/estimate.sql"), schema)
        .with("sample_percent", sample_percent("r.size"))
        .text();
    let mut q = QueryBuilder::new(seed);
    selection.push_conditions(&mut q);
    q.push(") * 100.0 / p.pct)::int8 FROM p");
    Ok(q.build_query_scalar().fetch_one(pool).await?)
}

/// One dead letter in full, or `None` when there is none with that id.
pub async fn dead_letter(
    pool: &PgPool,
    schema: &Ident,
    id: Uuid,
) -> Result<Option<DeadLetterDetail>> {
    Ok(
        sqlx::query_as(render(include_str!("dead_letters/detail.sql"), schema))
            .bind(id)
            .fetch_optional(pool)
            .await?,
    )
}

/// What a replay did.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Replayed {
    /// Events put back in the outbox.
    pub replayed: u64,
    /// Their ids.
    pub ids: Vec<Uuid>,
    /// Replayed events created before the retention window: consumers may
    /// have forgotten them already and would apply them again.
    pub older_than_retention: Vec<Uuid>,
    /// Dead letters kept because an event with the same id is in the outbox
    /// already (enqueued again, or replayed before): replaying would lose
    /// one of the two.
    pub conflicts: Vec<Uuid>,
    /// Dead letters kept because the table refuses them (a name over 255
    /// bytes: `outbox_unpublishable`, migration 11): they can never be
    /// published as they are.
    pub unpublishable: Vec<Uuid>,
}

/// How long one operator action (replay, purge) may run: a selection of
/// hundreds of thousands of dead letters is one transaction.
const ACTION_TIMEOUT: &str = "SET LOCAL statement_timeout = '10min'";

/// Puts dead letters back in the outbox, due now with attempts reset, in
/// one transaction. The event keeps its id, so consumers still deduplicate
/// it. Events older than `retention` are replayed but reported. A dead
/// letter whose id is in the outbox already, or that the table refuses,
/// stays where it is and is reported ([`Replayed::conflicts`],
/// [`Replayed::unpublishable`]): a dead letter is deleted only once its
/// event is back in the outbox.
///
/// `at_most`: the count an operator confirmed. When the selection holds
/// more dead letters than that by now, nothing changes and the answer is
/// [`Error::SelectionGrew`](super::Error::SelectionGrew).
pub async fn replay_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    retention: std::time::Duration,
    at_most: Option<u64>,
) -> Result<Replayed> {
    let mut tx = pool.begin().await?;
    sqlx::query(ACTION_TIMEOUT).execute(&mut *tx).await?;
    let selected = lock_selected(&mut *tx, schema, selection).await?;
    check_at_most(at_most, selected.len())?;
    let wanted: Vec<Uuid> = selected
        .iter()
        .filter(|c| !c.in_outbox && c.publishable)
        .map(|c| c.id)
        .collect();
    let rows = insert_into_outbox(&mut *tx, schema, &wanted, retention).await?;
    let replayed: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    delete_replayed(&mut *tx, schema, &replayed).await?;
    tx.commit().await?;
    let report = replay_report(&selected, &rows);
    if !report.older_than_retention.is_empty() {
        tracing::warn!(
            count = report.older_than_retention.len(),
            "replayed events older than the retention window: consumers may have forgotten them and apply them again"
        );
    }
    Ok(report)
}

/// A selected dead letter, as the replay found it.
struct Candidate {
    id: Uuid,
    /// An event with its id is in the outbox.
    in_outbox: bool,
    /// The outbox's CHECKs would take it.
    publishable: bool,
}

/// Each selected dead letter, locked: whether its id is in the outbox,
/// and whether the outbox's CHECKs would take it.
async fn lock_selected(
    tx: &mut PgConnection,
    schema: &Ident,
    selection: &Selection,
) -> Result<Vec<Candidate>> {
    let seed = render(include_str!("dead_letters/lock_selected.sql"), schema);
    let mut q = QueryBuilder::new(seed.as_str());
    selection.push_conditions(&mut q);
    q.push(" ORDER BY d.id FOR UPDATE OF d");
    let selected: Vec<(Uuid, bool, bool)> = q.build_query_as().fetch_all(&mut *tx).await?;
    Ok(selected
        .into_iter()
        .map(|(id, in_outbox, publishable)| Candidate {
            id,
            in_outbox,
            publishable,
        })
        .collect())
}

/// Copies the dead letters `ids` into the outbox, due now with attempts
/// reset and the replay appended to their error history (its last 20
/// entries kept, as every failure's); an id in the outbox already is left
/// out. Returns each inserted id and whether its event is older than
/// `retention`.
async fn insert_into_outbox(
    tx: &mut PgConnection,
    schema: &Ident,
    ids: &[Uuid],
    retention: std::time::Duration,
) -> Result<Vec<(Uuid, bool)>> {
    Ok(
        sqlx::query_as(render(include_str!("dead_letters/replay.sql"), schema))
            .bind(ids)
            .bind(retention.as_millis() as i64)
            .fetch_all(&mut *tx)
            .await?,
    )
}

/// Only what reached the outbox leaves the dead letters (an id a
/// producer inserted meanwhile is a conflict too).
async fn delete_replayed(tx: &mut PgConnection, schema: &Ident, replayed: &[Uuid]) -> Result<()> {
    sqlx::query(render(
        "DELETE FROM {schema}.outbox_dead_letters WHERE id = ANY($1)",
        schema,
    ))
    .bind(replayed)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What the replay did, from what it selected and what the outbox took
/// (`rows`: each inserted id, and whether it is older than the retention).
fn replay_report(selected: &[Candidate], rows: &[(Uuid, bool)]) -> Replayed {
    let replayed: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    let older: Vec<Uuid> = rows
        .iter()
        .filter(|(_, old)| *old)
        .map(|(id, _)| *id)
        .collect();
    let replayed_set: std::collections::HashSet<Uuid> = replayed.iter().copied().collect();
    let unpublishable: Vec<Uuid> = selected
        .iter()
        .filter(|c| !c.in_outbox && !c.publishable)
        .map(|c| c.id)
        .collect();
    // In the outbox already (whether or not the table would take it), or
    // inserted there by a producer meanwhile.
    let conflicts: Vec<Uuid> = selected
        .iter()
        .filter(|c| c.in_outbox || (c.publishable && !replayed_set.contains(&c.id)))
        .map(|c| c.id)
        .collect();
    Replayed {
        replayed: replayed.len() as u64,
        ids: replayed,
        older_than_retention: older,
        conflicts,
        unpublishable,
    }
}

/// Deletes dead letters for good. Returns their ids. `at_most` as for
/// [`replay_dead_letters`]: more than that, and nothing is deleted.
pub async fn purge_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    at_most: Option<u64>,
) -> Result<Vec<Uuid>> {
    let mut tx = pool.begin().await?;
    sqlx::query(ACTION_TIMEOUT).execute(&mut *tx).await?;
    let seed = render(
        "DELETE FROM {schema}.outbox_dead_letters d WHERE TRUE",
        schema,
    );
    let mut q = QueryBuilder::new(seed.as_str());
    selection.push_conditions(&mut q);
    q.push(" RETURNING d.id");
    let ids: Vec<Uuid> = q.build_query_scalar().fetch_all(&mut *tx).await?;
    // Dropping the transaction rolls the delete back.
    check_at_most(at_most, ids.len())?;
    tx.commit().await?;
    Ok(ids)
}

fn check_at_most(at_most: Option<u64>, found: usize) -> Result<()> {
    match at_most {
        Some(confirmed) if found as u64 > confirmed => Err(super::Error::SelectionGrew {
            confirmed,
            found: found as u64,
        }),
        _ => Ok(()),
    }
}
