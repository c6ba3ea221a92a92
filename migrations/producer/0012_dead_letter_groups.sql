-- Producer schema, version 12: dead letters grouped and searched without
-- re-reading their text (the console's Failures page and its filters).
--
-- `error_class` is the last error with what varies between events of one
-- failure normalised away: ids (UUIDs), quoted values, long hex strings and
-- numbers. Two events that failed the same way share a class, so the
-- console and `outbox-relay status` can count dead letters by failure and
-- filter on one with an index. `error_words` holds the error's words
-- (PostgreSQL's built-in 'simple' configuration) and each pair of adjacent
-- words as one more lexeme ('no route'), so a phrase filter finds through
-- the GIN index only the rows that hold the phrase's pairs, instead of
-- every row that holds its words anywhere and parsing each one's text
-- again (a phrase whose words are common but never adjacent took 150-340
-- ms on 200,000 dead letters; now under 1 ms).
--
-- Both are generated columns: the relay writes `last_error` as before.
-- Adding them rewrites the dead-letter table under a lock that blocks
-- dead-lettering while it runs (about 3 s per 100,000 rows here): apply
-- this migration when the table is small or the relays are stopped.

CREATE FUNCTION outbox_error_class(error text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN left(
    regexp_replace(
        regexp_replace(
            regexp_replace(
                regexp_replace(
                    error,
                    '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
                    '<id>', 'g'),
                '(^|[^[:alnum:]])("[^"]*"|''[^'']*'')', '\1"…"', 'g'),
            '\m(0x[0-9a-fA-F]+|[0-9a-fA-F]*[0-9][0-9a-fA-F]*[a-fA-F][0-9a-fA-F]*|[0-9a-fA-F]*[a-fA-F][0-9a-fA-F]*[0-9][0-9a-fA-F]*)\M',
            '<hex>', 'g'),
        '[0-9]+', '<n>', 'g'),
    200);

CREATE FUNCTION outbox_error_words(error text) RETURNS tsvector
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN to_tsvector('simple', error) || coalesce((
    SELECT array_to_tsvector(array_agg(DISTINCT a.lexeme || ' ' || b.lexeme))
    FROM (SELECT lexeme, unnest(positions) AS pos FROM unnest(to_tsvector('simple', error))) a
    JOIN (SELECT lexeme, unnest(positions) AS pos FROM unnest(to_tsvector('simple', error))) b
      ON b.pos = a.pos + 1), ''::tsvector);

ALTER TABLE outbox_dead_letters
    ADD COLUMN error_class text GENERATED ALWAYS AS (outbox_error_class(last_error)) STORED,
    ADD COLUMN error_words tsvector GENERATED ALWAYS AS (outbox_error_words(last_error)) STORED;

CREATE INDEX outbox_dead_letters_class_idx ON outbox_dead_letters (error_class, dead_lettered_at);
CREATE INDEX outbox_dead_letters_exchange_idx ON outbox_dead_letters (exchange, dead_lettered_at);
-- The list's "most attempts first" order.
CREATE INDEX outbox_dead_letters_attempts_idx ON outbox_dead_letters (attempts, dead_lettered_at);
-- fastupdate off: dead letters are few and written one by one, and a
-- pending list (up to 4 MB of new entries, merged only by VACUUM) is read
-- whole by every search: on a table autovacuum has not reached yet it cost
-- phrase filters 20-50 ms.
CREATE INDEX outbox_dead_letters_words_idx ON outbox_dead_letters USING gin (error_words)
    WITH (fastupdate = off);
DROP INDEX outbox_dead_letters_error_idx;
