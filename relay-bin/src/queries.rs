//! Every SQL statement of the relay, named, built once per schema (the
//! claims' text lives with the claim stage, in `claim/`). The
//! schema is a validated identifier; every value is bound (arrays for
//! batches), so the text is constant for the process's lifetime.

use outbox::Ident;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// The relay's statements for one schema.
#[derive(Debug, Clone)]
pub(crate) struct Queries {
    /// The unordered claim ([`crate::claim::unordered::statement`]).
    pub(crate) claim: SqlStr,
    /// The ordered claim ([`crate::claim::ordered::statement`]).
    pub(crate) claim_ordered: SqlStr,
    /// One lease round (`outbox_lease_tick`): `$1` relay id, `$2` name,
    /// `$3` TTL in ms. Returns the partitions held.
    pub(crate) lease_tick: SqlStr,
    /// Give up every lease of relay `$1` and leave the relay list.
    pub(crate) lease_release: SqlStr,
    /// Record relay `$1`'s broker node `$2` in the relay list.
    pub(crate) record_broker: SqlStr,
    /// Add `$1` published and `$2` dead-lettered events to this minute of
    /// `outbox_publish_stats` (the console's rate chart); rows older than
    /// 7 days go.
    pub(crate) publish_stats: SqlStr,
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
    /// Of the ordered aggregates `$1` types, `$2` ids, those with events in
    /// the outbox table: the log's reader queues their events behind them.
    pub(crate) wal_queued: SqlStr,
    /// Events of the log the reader did not deliver, into the outbox table
    /// as never attempted (the settle that follows records the attempt).
    /// `$1`..`$10`: ids, aggregate types and ids, event types, payloads,
    /// headers, exchanges, routing keys, creation times, sequences.
    pub(crate) wal_divert: SqlStr,
    /// Messages of the log that are no event, into the dead letters. `$1`
    /// ids, `$2` positions, `$3` contents, `$4` errors.
    pub(crate) wal_unreadable: SqlStr,
    /// One event of the log that the outbox table refuses, straight into
    /// the dead letters. `$1` id, `$2` aggregate type, `$3` aggregate id,
    /// `$4` event type, `$5` payload, `$6` headers (JSON text), `$7`
    /// exchange, `$8` routing key, `$9` creation time, `$10` sequence,
    /// `$11` attempts, `$12` error.
    pub(crate) wal_dead_letter: SqlStr,
}

pub(crate) fn sql(text: String) -> SqlStr {
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
            claim: crate::claim::unordered::statement(schema),
            claim_ordered: crate::claim::ordered::statement(schema),
            lease_tick: sql(format!(
                "SELECT p FROM {s}.outbox_lease_tick($1, $2, $3 * interval '1 millisecond') AS p"
            )),
            record_broker: sql(format!(
                "UPDATE {s}.outbox_relays SET broker = $2 WHERE id = $1"
            )),
            publish_stats: sql(format!(
                "WITH up AS (
                     INSERT INTO {s}.outbox_publish_stats AS t (minute, published, dead_lettered)
                     VALUES (date_trunc('minute', now()), $1, $2)
                     ON CONFLICT (minute) DO UPDATE
                     SET published = t.published + EXCLUDED.published,
                         dead_lettered = t.dead_lettered + EXCLUDED.dead_lettered)
                 DELETE FROM {s}.outbox_publish_stats WHERE minute < now() - interval '7 days'"
            )),
            lease_release: sql(format!(
                "WITH r AS (DELETE FROM {s}.outbox_relays WHERE id = $1)
                 UPDATE {s}.outbox_leases SET owner = NULL, owner_name = NULL, expires_at = '-infinity'
                 WHERE owner = $1"
            )),
            delete: sql(format!("DELETE FROM {s}.outbox WHERE id = ANY($1)")),
            event_seq: sql(format!("SELECT aggregate_seq FROM {s}.outbox WHERE id = $1")),
            wal_queued: sql(format!(
                "SELECT DISTINCT o.aggregate_type, o.aggregate_id
                 FROM unnest($1::text[], $2::text[]) AS a(aggregate_type, aggregate_id)
                 JOIN {s}.outbox o ON o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
                 WHERE o.aggregate_seq IS NOT NULL"
            )),
            wal_divert: sql(format!(
                "INSERT INTO {s}.outbox
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                      created_at, aggregate_seq)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange,
                        routing_key, created_at, aggregate_seq
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                             $8::text[], $9::timestamptz[], $10::bigint[])
                      AS e(id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                           created_at, aggregate_seq)
                 ON CONFLICT DO NOTHING"
            )),
            wal_unreadable: sql(format!(
                "INSERT INTO {s}.outbox_dead_letters
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
                      last_error, error_history)
                 SELECT id, '(unreadable)', 'lsn ' || lsn, '(unreadable)', to_jsonb(content), '{{}}'::jsonb, now(), 0,
                        error, jsonb_build_array(jsonb_build_object('at', now(), 'error', error))
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]) AS u(id, lsn, content, error)
                 ON CONFLICT (id) DO NOTHING"
            )),
            wal_dead_letter: sql(format!(
                "INSERT INTO {s}.outbox_dead_letters
                     (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
                      created_at, aggregate_seq, attempts, last_error, error_history)
                 VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8, $9, $10, $11, $12,
                         jsonb_build_array(jsonb_build_object('at', now(), 'error', $12::text)))
                 ON CONFLICT (id) DO NOTHING"
            )),
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
