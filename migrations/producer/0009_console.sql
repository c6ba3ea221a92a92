-- Producer schema, version 9: what the operator console (`outbox-relay
-- console`) reads without scanning a table.
--
-- The dead-letter filters page newest first through an index each, so a
-- page costs its rows on any size of table: event type; aggregate id (with
-- or without its type); the words of the last error (full-text, the built-in 'simple'
-- configuration: no stemming, no stop words, case-insensitive; no
-- extension needed). On a large existing dead-letter table these CREATE
-- INDEX statements take a lock that blocks dead-lettering while they run:
-- apply this migration when the table is small, or create the three
-- indexes CONCURRENTLY by hand first (same names; IF NOT EXISTS skips them
-- here). A CONCURRENTLY build that fails leaves an INVALID index of that
-- name, which IF NOT EXISTS would keep: drop it and build it again before
-- migrating (`\d outbox_dead_letters` in psql marks it INVALID).
CREATE INDEX IF NOT EXISTS outbox_dead_letters_type_idx
    ON outbox_dead_letters (event_type, dead_lettered_at);
CREATE INDEX IF NOT EXISTS outbox_dead_letters_aggregate_idx
    ON outbox_dead_letters (aggregate_id, dead_lettered_at);
CREATE INDEX IF NOT EXISTS outbox_dead_letters_error_idx
    ON outbox_dead_letters USING gin (to_tsvector('simple', last_error));

-- Events each relay settled, per minute: the console's publish-rate chart.
-- Relays add their counts at each lease round (a few seconds apart) with one
-- upsert; rows older than 7 days are deleted by the same statement.
CREATE TABLE outbox_publish_stats (
    minute        timestamptz PRIMARY KEY,
    published     bigint      NOT NULL DEFAULT 0 CHECK (published >= 0),
    dead_lettered bigint      NOT NULL DEFAULT 0 CHECK (dead_lettered >= 0)
);
