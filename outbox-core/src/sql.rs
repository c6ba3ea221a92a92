//! The toolkit's one way to write SQL that names a schema (or another
//! identifier): a template, rendered once.
//!
//! - A statement that names a schema is a template: a `.sql` file beside
//!   the module that runs it, read in with `include_str!` (a one-line
//!   statement may be a string literal in place). A statement that names
//!   none (a catalog query) is a literal where it runs.
//! - A template names identifiers only by placeholders: `{schema}` for the
//!   quoted schema (a validated [`Ident`]) and whatever else its crate
//!   passes to [`Template::with`] (column lists, a table name). Values are
//!   never placed in the text: they are bound (`$1`, arrays for batches).
//! - Templates are rendered once, when the handle, relay stage or consumer
//!   that runs them is built, and kept as [`SqlStr`]s: each text is
//!   constant for the process's lifetime, so the server's prepared
//!   statement cache holds one entry per statement.
//! - A statement whose shape follows its input (an operator's filter) is
//!   built with `sqlx::QueryBuilder`, seeded with a rendered template and
//!   every value pushed as a bind.
//! - `--` comment lines are for the reader of the file and are dropped:
//!   `pg_stat_activity` shows the statement itself.
//! - One fragment is shared by every template that records a failure:
//!   `{error_history(HISTORY, ERROR)}` becomes the `error_history` jsonb
//!   array HISTORY with `{"at": now(), "error": ERROR}` appended, keeping
//!   the last [`ERRORS_KEPT`] entries (the outbox table's contract,
//!   `docs/OUTBOX_TABLE.md`). Its arguments are SQL expressions without a
//!   comma of their own.
//!
//! No other code in the workspace puts an identifier into SQL text
//! (`relay/tests/architecture.rs` checks that no `format!` reaches
//! `AssertSqlSafe`).

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::Ident;

/// How many entries of an event's `error_history` are kept: the last.
pub const ERRORS_KEPT: usize = 20;

/// The SQL of `history` (a jsonb array expression) with `error` (a text
/// expression) appended as `{"at": now(), "error": ...}`, its oldest entry
/// dropped when it holds [`ERRORS_KEPT`] already.
fn error_history(history: &str, error: &str) -> String {
    format!(
        "(CASE WHEN jsonb_array_length({history}) >= {ERRORS_KEPT} THEN {history} - 0 ELSE {history} END) \
         || jsonb_build_array(jsonb_build_object('at', now(), 'error', {error}))"
    )
}

/// `text` with each `{error_history(HISTORY, ERROR)}` expanded.
fn expand_error_history(text: &str) -> String {
    const OPEN: &str = "{error_history(";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let args_at = at + OPEN.len();
        let Some(len) = rest[args_at..].find(")}") else {
            break;
        };
        let args = &rest[args_at..args_at + len];
        let Some((history, error)) = args.split_once(',') else {
            break;
        };
        out.push_str(&rest[..at]);
        out.push_str(&error_history(history.trim(), error.trim()));
        rest = &rest[args_at + len + 2..];
    }
    out.push_str(rest);
    out
}

/// A statement's text with `{name}` placeholders, and what they become.
#[derive(Debug, Clone)]
#[must_use = "a template does nothing until rendered"]
pub struct Template<'a> {
    text: &'a str,
    values: Vec<(&'static str, String)>,
}

impl<'a> Template<'a> {
    /// `text`, with `{schema}` to become `schema` quoted.
    pub fn new(text: &'a str, schema: &Ident) -> Self {
        Self::unqualified(text).with("schema", schema.quoted())
    }

    /// `text`, naming no schema (placeholders, if any, are given by
    /// [`Template::with`]).
    pub fn unqualified(text: &'a str) -> Self {
        Self {
            text,
            values: Vec::new(),
        }
    }

    /// `{name}` becomes `value`. `value` must be SQL the caller vouches
    /// for: a quoted [`Ident`], a column list of its own, never input.
    pub fn with(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.values.push((name, value.into()));
        self
    }

    /// The text without its comment lines, the placeholders replaced
    /// (other braces, such as `'{}'`, are kept).
    pub fn text(&self) -> String {
        let mut text = self
            .text
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        for (name, value) in &self.values {
            text = text.replace(&format!("{{{name}}}"), value);
        }
        expand_error_history(&text)
    }

    /// The statement, ready for `sqlx::query`.
    pub fn render(&self) -> SqlStr {
        AssertSqlSafe(self.text()).into_sql_str()
    }
}

/// `text` for `schema`: [`Template::new`] rendered.
pub fn render(text: &str, schema: &Ident) -> SqlStr {
    Template::new(text, schema).render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_go_placeholders_are_replaced_and_other_braces_kept() {
        let schema = Ident::new("schema", "shop").unwrap();
        let sql = Template::new(
            "-- what it does\n  -- indented\nSELECT {columns} FROM {schema}.outbox\nWHERE headers = '{}'",
            &schema,
        )
        .with("columns", "id, payload")
        .render();
        assert_eq!(
            sql.as_str(),
            "SELECT id, payload FROM \"shop\".outbox\nWHERE headers = '{}'"
        );
    }

    #[test]
    fn the_error_history_fragment_takes_its_two_expressions() {
        let sql = Template::unqualified(
            "SET error_history = {error_history(o.error_history, f.error)}, x = 1",
        )
        .render();
        assert_eq!(
            sql.as_str(),
            "SET error_history = (CASE WHEN jsonb_array_length(o.error_history) >= 20 \
             THEN o.error_history - 0 ELSE o.error_history END) \
             || jsonb_build_array(jsonb_build_object('at', now(), 'error', f.error)), x = 1"
        );
        let two =
            Template::unqualified("{error_history('[]'::jsonb, $1::text)} {error_history(h, e)}")
                .text();
        assert_eq!(two.matches("jsonb_build_object").count(), 2, "{two}");
        assert!(!two.contains("{error_history"), "{two}");
    }

    #[test]
    fn a_placeholder_without_a_value_stays_as_it_is() {
        let sql = Template::unqualified("SELECT '{schema}'").render();
        assert_eq!(sql.as_str(), "SELECT '{schema}'");
    }
}
