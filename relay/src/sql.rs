//! The relay's statements are `.sql` files beside the stage that runs
//! them (`claim/*.sql`, `lease/*.sql`, `settle/*.sql`, `quarantine/*.sql`,
//! `wal/*.sql`, `wal/divert/*.sql`), read in at compile time and rendered
//! once per relay by the workspace's one renderer
//! ([`outbox_core::sql`]): `{schema}` becomes the quoted schema (a
//! validated identifier), `{event_columns}` and `{row_columns}` the
//! column lists below. Every value is bound (arrays for batches), so each
//! text is constant for the process's lifetime.

use outbox::Ident;
use outbox_core::sql::Template;
use sqlx::SqlStr;

/// An event's columns as it moves between the outbox, the archive and the
/// dead letters, in this order.
pub(crate) const EVENT_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload, headers, \
     exchange, routing_key, created_at, aggregate_seq";

/// Columns every claim returns, in this order (the shape of
/// [`EventRow`](crate::message::EventRow)).
pub(crate) const ROW_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     headers::text AS headers, exchange, routing_key, created_at, attempts, aggregate_seq";

/// `template` for `schema`, with the relay's column lists.
pub(crate) fn render(template: &str, schema: &Ident) -> SqlStr {
    Template::new(template, schema)
        .with("event_columns", EVENT_COLUMNS)
        .with("row_columns", ROW_COLUMNS)
        .render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_lists_are_placeholders() {
        let schema = Ident::new("schema", "shop").unwrap();
        let sql = render(
            "-- what it does\nSELECT {event_columns} FROM {schema}.outbox RETURNING {row_columns}",
            &schema,
        );
        let text = sql.as_str();
        assert!(text.starts_with("SELECT id, aggregate_type,"), "{text}");
        assert!(text.contains(r#""shop".outbox"#), "{text}");
        assert!(text.ends_with("attempts, aggregate_seq"), "{text}");
    }
}
