//! Pages of dead letters in three orders, forwards and backwards (keyset
//! paging: a page costs its rows however deep it is), and a sample of what
//! an action selects.

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::sql::Template;
use sqlx::{PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::Result;
use super::dead_letters::{DeadLetter, Filter, Selection};

/// The order of a list of dead letters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Order {
    /// Most recently dead-lettered first.
    #[default]
    Newest,
    /// Longest dead-lettered first.
    Oldest,
    /// Most attempts first (then newest first).
    MostAttempts,
}

impl Order {
    /// The sort key's columns (alias `d`), and whether it runs descending.
    fn key(self) -> (&'static str, bool) {
        match self {
            Order::Newest => ("(d.dead_lettered_at, d.id)", true),
            Order::Oldest => ("(d.dead_lettered_at, d.id)", false),
            Order::MostAttempts => ("(d.attempts, d.dead_lettered_at, d.id)", true),
        }
    }
}

/// A row's place in every order: the page boundaries the links carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The row's attempts.
    pub attempts: i32,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
    /// Its id.
    pub id: Uuid,
}

impl From<&DeadLetter> for Cursor {
    fn from(d: &DeadLetter) -> Cursor {
        Cursor {
            attempts: d.attempts,
            dead_lettered_at: d.dead_lettered_at,
            id: d.id,
        }
    }
}

/// Which page of a list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PageAt {
    /// The first.
    #[default]
    First,
    /// The rows right after this one, in the list's order.
    After(Cursor),
    /// The rows right before this one, in the list's order.
    Before(Cursor),
}

/// A page of dead letters, in the list's order.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetterPage {
    /// Its rows.
    pub rows: Vec<DeadLetter>,
    /// Rows come before the first of this page.
    pub has_previous: bool,
    /// Rows come after the last of this page.
    pub has_next: bool,
}

/// The columns of a [`DeadLetter`] (alias `d`): a template's `{columns}`.
const COLUMNS: &str = "d.id, d.aggregate_type, d.aggregate_id, d.event_type, d.attempts, \
                       d.last_error, d.created_at, d.dead_lettered_at, d.exchange, d.routing_key";

/// Rows a text filter checks, newest first in the list's order, before it
/// asks the GIN index for every match.
const TEXT_WINDOW: i64 = 2_000;

/// Up to `limit` dead letters matching `filter` in `order`, at `at`.
///
/// With error words, the next 2,000 rows in the list's order are
/// checked first: a common phrase fills the page from them. Only when they
/// do not fill it is every match read through the GIN index and sorted,
/// which is cheap exactly then (the phrase is rare).
pub async fn page_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    filter: &Filter,
    order: Order,
    at: PageAt,
    limit: i64,
) -> Result<DeadLetterPage> {
    if filter.error_words.is_some() {
        let q = query(schema, filter, order, at, limit, Some(TEXT_WINDOW));
        let rows = fetch(pool, q).await?;
        if rows.len() as i64 > limit {
            return Ok(page(rows, at, limit));
        }
    }
    let rows = fetch(pool, query(schema, filter, order, at, limit, None)).await?;
    Ok(page(rows, at, limit))
}

async fn fetch(pool: &PgPool, mut q: QueryBuilder<Postgres>) -> Result<Vec<DeadLetter>> {
    Ok(q.build_query_as().fetch_all(pool).await?)
}

/// The statement for a page: `limit + 1` rows (the one more says whether
/// a page follows), walking backwards in reverse order. With a `window`,
/// the error words are checked on the first `window` rows of the rest of
/// the filter only.
fn query(
    schema: &Ident,
    filter: &Filter,
    order: Order,
    at: PageAt,
    limit: i64,
    window: Option<i64>,
) -> QueryBuilder<Postgres> {
    let (key, descending) = order.key();
    // Walking backwards reads the list's order reversed, then turns it round.
    let down = descending != matches!(at, PageAt::Before(_));
    // The key's columns, each followed by the direction.
    let order_by = if down {
        key.trim_matches(['(', ')']).replace(", ", " DESC, ") + " DESC"
    } else {
        key.trim_matches(['(', ')']).replace(", ", " ASC, ") + " ASC"
    };
    // Error words: with a window, checked on its rows; without, every match
    // through the GIN index, fenced (`OFFSET 0`) from the order and the
    // limit, or the planner walks the order's index through every row in
    // the hope of finding a page soon.
    let words = filter.error_words.is_some();
    let seed = if words {
        "SELECT {columns} FROM (SELECT d.* FROM {schema}.outbox_dead_letters d WHERE TRUE"
    } else {
        "SELECT {columns} FROM {schema}.outbox_dead_letters d WHERE TRUE"
    };
    let mut q = QueryBuilder::new(Template::new(seed, schema).with("columns", COLUMNS).text());
    let mut rest = filter.clone();
    if window.is_some() {
        rest.error_words = None;
    }
    rest.push_conditions(&mut q);
    if let PageAt::After(c) | PageAt::Before(c) = at {
        q.push(" AND ")
            .push(key)
            .push(if down { " < " } else { " > " });
        push_cursor(&mut q, order, c);
    }
    match (window, &filter.error_words) {
        (Some(w), Some(words)) => {
            q.push(" ORDER BY ")
                .push(&order_by)
                .push(" LIMIT ")
                .push_bind(w)
                .push(") d WHERE TRUE");
            crate::admin::dead_letters::push_phrase(&mut q, words);
        }
        (None, Some(_)) => {
            q.push(" OFFSET 0) d");
        }
        _ => {}
    }
    q.push(" ORDER BY ")
        .push(&order_by)
        .push(" LIMIT ")
        .push_bind(limit + 1);
    q
}

/// The rows in the list's order, and whether pages come before and after.
fn page(mut rows: Vec<DeadLetter>, at: PageAt, limit: i64) -> DeadLetterPage {
    let backwards = matches!(at, PageAt::Before(_));
    let more = rows.len() as i64 > limit;
    rows.truncate(limit.max(0) as usize);
    if backwards {
        rows.reverse();
    }
    let beyond_cursor = !matches!(at, PageAt::First);
    DeadLetterPage {
        rows,
        has_previous: if backwards { more } else { beyond_cursor },
        has_next: if backwards { beyond_cursor } else { more },
    }
}

fn push_cursor(q: &mut QueryBuilder<Postgres>, order: Order, c: Cursor) {
    q.push("(");
    if order == Order::MostAttempts {
        q.push_bind(c.attempts).push(", ");
    }
    q.push_bind(c.dead_lettered_at)
        .push(", ")
        .push_bind(c.id)
        .push(")");
}

/// The newest `limit` dead letters an action on `selection` would touch
/// (what a confirmation page shows).
pub async fn sample_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    selection: &Selection,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    if let Selection::Matching(filter) = selection {
        let first = page_dead_letters(pool, schema, filter, Order::Newest, PageAt::First, limit);
        return Ok(first.await?.rows);
    }
    let seed = "SELECT {columns} FROM {schema}.outbox_dead_letters d WHERE TRUE";
    let mut q = QueryBuilder::new(Template::new(seed, schema).with("columns", COLUMNS).text());
    selection.push_conditions(&mut q);
    q.push(" ORDER BY d.dead_lettered_at DESC, d.id DESC LIMIT ")
        .push_bind(limit);
    Ok(q.build_query_as().fetch_all(pool).await?)
}

/// Lists up to `limit` dead letters, newest first.
pub async fn list_dead_letters(
    pool: &PgPool,
    schema: &Ident,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    let page = page_dead_letters(
        pool,
        schema,
        &Filter::default(),
        Default::default(),
        Default::default(),
        limit,
    )
    .await?;
    Ok(page.rows)
}
