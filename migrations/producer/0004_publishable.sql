-- Producer schema, version 4: the table refuses rows that can never be
-- published. AMQP short strings (exchange, routing key, message type,
-- header names) hold at most 255 bytes; a row with a longer one would sit
-- in the outbox until the relay dead-lettered it. Every writer (the Rust
-- library, SQL, other languages) now gets the error at insert instead.
--
-- NOT VALID: rows already in the table are not checked (the relay still
-- dead-letters such rows with their reason, or blocks an ordered one's
-- aggregate); every new row is.
-- See docs/OUTBOX_TABLE.md.

-- True when every key of a headers object fits an AMQP short string.
-- Nested objects travel as JSON text, so only top-level keys count.
CREATE FUNCTION outbox_header_names_fit(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
    SELECT jsonb_typeof(h) <> 'object'
        OR NOT EXISTS (SELECT 1 FROM jsonb_object_keys(h) AS k WHERE octet_length(k) > 255)
$fn$;

-- A row the relay has already tried (attempts > 0) is exempt: a NOT VALID
-- CHECK still applies to every UPDATE, and the relay must be able to
-- record its failure on such an old row (an ordered one is rescheduled,
-- never dead-lettered) instead of failing its settle for ever.
ALTER TABLE outbox ADD CONSTRAINT outbox_names_publishable CHECK (
    attempts > 0 OR (
        octet_length(event_type) <= 255
        AND (exchange IS NULL OR octet_length(exchange) <= 255)
        AND octet_length(coalesce(routing_key, aggregate_type || '.' || event_type)) <= 255)
) NOT VALID;

ALTER TABLE outbox ADD CONSTRAINT outbox_headers_publishable
    CHECK (attempts > 0 OR outbox_header_names_fit(headers)) NOT VALID;
