//! The relay's statements are `.sql` files beside the stage that runs
//! them (`claim/*.sql`, `lease/*.sql`, `settle/*.sql`, `quarantine/*.sql`,
//! `wal/divert/*.sql`), read in at compile time and rendered once per
//! relay: `{schema}` becomes the quoted schema (a validated identifier),
//! `{event_columns}` and `{claimed_columns}` the column lists below. Every
//! value is bound (arrays for batches), so each text is constant for the
//! process's lifetime.

use outbox::Ident;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// An event's columns as it moves between the outbox, the archive and the
/// dead letters, in this order.
pub(crate) const EVENT_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload, headers, \
     exchange, routing_key, created_at, aggregate_seq";

/// Columns every claim returns, in this order (the shape of
/// [`EventRow`](crate::message::EventRow)).
pub(crate) const CLAIMED_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     headers::text AS headers, exchange, routing_key, created_at, attempts, aggregate_seq";

/// `template` for `schema`, without its comment lines (they are for the
/// reader of the file; `pg_stat_activity` shows the statement itself).
pub(crate) fn render(template: &str, schema: &Ident) -> SqlStr {
    let text: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    let text = text
        .replace("{schema}", &schema.quoted())
        .replace("{event_columns}", EVENT_COLUMNS)
        .replace("{claimed_columns}", CLAIMED_COLUMNS);
    AssertSqlSafe(text).into_sql_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_go_placeholders_are_replaced_and_other_braces_kept() {
        let schema = Ident::new("schema", "shop").unwrap();
        let sql = render(
            "-- what it does\nSELECT {event_columns} FROM {schema}.outbox WHERE headers = '{}'",
            &schema,
        );
        let text = sql.as_str();
        assert!(text.starts_with("SELECT id, aggregate_type,"), "{text}");
        assert!(text.contains(r#""shop".outbox"#), "{text}");
        assert!(text.ends_with("'{}'"), "{text}");
    }
}
