//! Every SQL statement of the relay, named, built once per schema. The
//! schema is a validated identifier; every value is bound (arrays for
//! batches), so the text is constant for the process's lifetime.

use outbox::Ident;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// Columns every claim returns, in this order.
pub(crate) const CLAIM_COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     headers::text AS headers, exchange, routing_key, created_at, attempts, aggregate_seq";

/// The relay's statements for one schema.
#[derive(Debug, Clone)]
pub(crate) struct Queries {
    /// Claim due unordered events, oldest first, skipping rows other relays
    /// hold. `$1` batch size.
    pub(crate) claim: SqlStr,
    /// Claim ordered events of the partitions this relay leases (`$1`
    /// relay id) and this worker serves (`partition % $2 = $3`): the due
    /// heads of up to `$4` aggregates per partition, in key order after the
    /// worker's cursor (`$5` partitions, `$6` types, `$7` ids), looking at
    /// `$9` aggregates per partition at most, and the events after each due
    /// head, at most about `$8` in all. Heads not due come back alone with
    /// `due` false (they only move the cursor). The lease rows are
    /// held FOR KEY SHARE until the transaction ends, so no lease changes
    /// owner under a batch in flight (renewals go through).
    pub(crate) claim_ordered: SqlStr,
    /// One lease round (`outbox_lease_tick`): `$1` relay id, `$2` name,
    /// `$3` TTL in ms. Returns the partitions held.
    pub(crate) lease_tick: SqlStr,
    /// Give up every lease of relay `$1` and leave the relay list.
    pub(crate) lease_release: SqlStr,
    /// Record relay `$1`'s broker node `$2` in the relay list.
    pub(crate) record_broker: SqlStr,
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
    /// The `aggregate_seq` of event `$1` (no row: it left the outbox).
    pub(crate) event_seq: SqlStr,
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
                 WHERE available_at <= now() AND aggregate_seq IS NULL
                 ORDER BY available_at, id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED"
            )),
            claim_ordered: sql(format!(
                "WITH parts AS (
                     SELECT partition FROM {s}.outbox_leases
                     WHERE owner = $1 AND expires_at > now() AND partition % $2 = $3
                     FOR KEY SHARE),
                 cursor AS (SELECT * FROM unnest($5::int[], $6::text[], $7::text[]) AS c(partition, t, a)),
                 heads AS MATERIALIZED (
                     SELECT parts.partition, h.*, row_number() OVER () AS ord
                     FROM parts LEFT JOIN cursor USING (partition)
                     CROSS JOIN LATERAL {s}.outbox_heads(
                         parts.partition, coalesce(cursor.t, ''), coalesce(cursor.a, ''), $4, $9) h),
                 run AS (SELECT greatest(1, $8 / greatest(count(*) FILTER (WHERE due), 1)) AS n FROM heads)
                 SELECT r.*, heads.due AND r.available_at <= now() AS due, heads.partition
                 FROM heads CROSS JOIN run CROSS JOIN LATERAL (
                     SELECT {CLAIM_COLUMNS}, available_at FROM {s}.outbox x
                     WHERE x.aggregate_type = heads.aggregate_type AND x.aggregate_id = heads.aggregate_id
                       AND x.aggregate_seq >= heads.aggregate_seq
                     ORDER BY x.aggregate_seq
                     LIMIT CASE WHEN heads.due THEN run.n ELSE 1 END) r
                 ORDER BY heads.ord, r.aggregate_seq"
            )),
            lease_tick: sql(format!(
                "SELECT p FROM {s}.outbox_lease_tick($1, $2, $3 * interval '1 millisecond') AS p"
            )),
            record_broker: sql(format!(
                "UPDATE {s}.outbox_relays SET broker = $2 WHERE id = $1"
            )),
            lease_release: sql(format!(
                "WITH r AS (DELETE FROM {s}.outbox_relays WHERE id = $1)
                 UPDATE {s}.outbox_leases SET owner = NULL, owner_name = NULL, expires_at = '-infinity'
                 WHERE owner = $1"
            )),
            delete: sql(format!("DELETE FROM {s}.outbox WHERE id = ANY($1)")),
            event_seq: sql(format!("SELECT aggregate_seq FROM {s}.outbox WHERE id = $1")),
            archive: sql(format!(
                "WITH d AS (DELETE FROM {s}.outbox WHERE id = ANY($1) RETURNING *)
                 INSERT INTO {s}.outbox_published
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, created_at, attempts, aggregate_seq)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key, created_at, attempts + 1, aggregate_seq
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
                      created_at, attempts, last_error, error_history, aggregate_seq)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                        created_at, attempts + 1, final_error, {history}, aggregate_seq
                 FROM d
                 ON CONFLICT (id) DO UPDATE SET
                     payload = EXCLUDED.payload, headers = EXCLUDED.headers, exchange = EXCLUDED.exchange,
                     routing_key = EXCLUDED.routing_key, attempts = EXCLUDED.attempts,
                     last_error = EXCLUDED.last_error, error_history = EXCLUDED.error_history,
                     aggregate_seq = EXCLUDED.aggregate_seq, dead_lettered_at = now()",
                history = history_push("d.error_history", "d.final_error"),
            )),
        }
    }
}
