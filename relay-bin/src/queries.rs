//! Every SQL statement of the relay, named, built once per schema. The
//! schema is a validated identifier; every value is bound (arrays for
//! batches), so the text is constant for the process's lifetime.

use outbox::Ident;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// Columns every claim returns, in this order.
pub(crate) const CLAIM_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     headers::text AS headers, exchange, routing_key, created_at, attempts";

/// The relay's statements for one schema.
#[derive(Debug, Clone)]
pub(crate) struct Queries {
    /// Claim due events, oldest first, skipping rows other relays hold.
    /// `$1` batch size.
    pub(crate) claim: SqlStr,
    /// Remove delivered events. `$1` ids.
    pub(crate) delete: SqlStr,
    /// Move delivered events to `outbox_published`. `$1` ids.
    pub(crate) archive: SqlStr,
    /// Record a failed attempt and when to try again. `$1` ids, `$2` delays
    /// in ms, `$3` errors.
    pub(crate) reschedule: SqlStr,
    /// Move events to the dead-letter table with their history. `$1` ids,
    /// `$2` final errors.
    pub(crate) dead_letter: SqlStr,
}

fn sql(text: String) -> SqlStr {
    AssertSqlSafe(text).into_sql_str()
}

/// Appends `{at, error}` to an error history, keeping the last 20 entries.
fn history_push(history: &str, error: &str) -> String {
    format!(
        "(CASE WHEN jsonb_array_length({history}) >= 20 THEN {history} - 0 ELSE {history} END) \
         || jsonb_build_array(jsonb_build_object('at', now(), 'error', {error}))"
    )
}

impl Queries {
    pub(crate) fn new(schema: &Ident) -> Self {
        let s = schema.quoted();
        Self {
            claim: sql(format!(
                "SELECT {CLAIM_COLUMNS} FROM {s}.outbox
                 WHERE available_at <= now()
                 ORDER BY available_at, id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED"
            )),
            delete: sql(format!("DELETE FROM {s}.outbox WHERE id = ANY($1)")),
            archive: sql(format!(
                "WITH d AS (DELETE FROM {s}.outbox WHERE id = ANY($1) RETURNING *)
                 INSERT INTO {s}.outbox_published
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, created_at, attempts)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, created_at, attempts + 1
                 FROM d
                 ON CONFLICT (id) DO NOTHING"
            )),
            reschedule: sql(format!(
                "UPDATE {s}.outbox o
                 SET attempts = o.attempts + 1,
                     available_at = now() + f.delay_ms * interval '1 millisecond',
                     last_error = f.error,
                     error_history = {history}
                 FROM unnest($1::uuid[], $2::bigint[], $3::text[]) AS f(id, delay_ms, error)
                 WHERE o.id = f.id",
                history = history_push("o.error_history", "f.error"),
            )),
            dead_letter: sql(format!(
                "WITH f AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS f(id, error)),
                      d AS (DELETE FROM {s}.outbox o USING f WHERE o.id = f.id
                            RETURNING o.*, f.error AS final_error)
                 INSERT INTO {s}.outbox_dead_letters
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                      created_at, attempts, last_error, error_history)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                        created_at, attempts + 1, final_error, {history}
                 FROM d
                 ON CONFLICT (id) DO UPDATE SET
                     payload = EXCLUDED.payload, headers = EXCLUDED.headers, exchange = EXCLUDED.exchange,
                     routing_key = EXCLUDED.routing_key, attempts = EXCLUDED.attempts,
                     last_error = EXCLUDED.last_error, error_history = EXCLUDED.error_history,
                     dead_lettered_at = now()",
                history = history_push("d.error_history", "d.final_error"),
            )),
        }
    }
}
