//! The operator views' one sampling policy: where a count would read too
//! much, a `TABLESAMPLE SYSTEM` of about [`SAMPLE_PAGES`] pages of the
//! table is counted and scaled up (the rows of a table never analysed,
//! [`estimated_rows`]; the backlog per type,
//! [`backlog_by_type`](super::backlog_by_type); the dead letters a
//! selection holds, [`estimate_dead_letters`](super::estimate_dead_letters)).

use outbox::Ident;
use outbox_core::sql::Template;

/// Pages an estimate reads (6.4 MiB of 8 KiB pages). How many pages
/// `TABLESAMPLE SYSTEM` picks varies from call to call (about ±1/sqrt(n)):
/// at 200 pages that put about one estimate in ten outside 15% (the admin
/// test failed 2 runs of 7); at 800 the spread is about ±3.5%.
pub(crate) const SAMPLE_PAGES: u32 = 800;

/// The percentage of a relation's pages that `TABLESAMPLE SYSTEM` reads to
/// see about `{pages}` of them; `{relation_size}` is its size in bytes.
const SAMPLE_PERCENT: &str = "least(100, {pages} * 100.0 * current_setting('block_size')::float8 \
     / greatest(1, {relation_size}))::float4";

/// SQL for the percentage of a relation's pages that `TABLESAMPLE SYSTEM`
/// reads to see about [`SAMPLE_PAGES`] of them (a `float4`, at most 100);
/// `relation_size` is an SQL expression of its size in bytes, naming no
/// schema (a column, `pg_relation_size(c.oid)`).
pub(crate) fn sample_percent(relation_size: &str) -> String {
    Template::unqualified(SAMPLE_PERCENT)
        .with("pages", SAMPLE_PAGES.to_string())
        .with("relation_size", relation_size)
        .text()
}

/// SQL for the rows of `schema`'s `table` now (a scalar subquery, `float8`;
/// NULL when there is no such table), without scanning it: the last
/// statistics' rows per page times the table's current pages (so a table
/// that grew since is not taken for small); never analysed (a freshly
/// loaded or restored table), the rows in a sample of about
/// [`SAMPLE_PAGES`] of its pages (`TABLESAMPLE SYSTEM`), scaled up.
pub(crate) fn estimated_rows(schema: &Ident, table: &'static str) -> String {
    Template::new(include_str!("estimate/estimated_rows.sql"), schema)
        .with("table", table)
        .with("sample_percent", sample_percent("pg_relation_size(c.oid)"))
        .text()
}
