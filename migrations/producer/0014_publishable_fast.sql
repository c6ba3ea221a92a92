-- Producer schema, version 14: the publishable CHECKs of version 11 at the
-- price of an expression for the common row.
--
-- Version 11's CHECKs call `outbox_unpublishable`, a SQL function, on every
-- row. PostgreSQL prepares a table's CHECKs again for every INSERT
-- statement, and a SQL function named in an expression is parsed then to
-- see whether it can be inlined (this one cannot: its header test holds a
-- subquery), then planned and run for each row. Measured with one insert
-- and its event per transaction (docs/BENCHMARKS.md, "the write path's
-- price"), that cost the producers about a third of their rate.
--
-- Each CHECK now tests first, inline, a condition under which the row is
-- certainly publishable: every name within 255 bytes; headers whose whole
-- JSON text is within 255 bytes (no key of a shorter text can be longer).
-- Only a row that fails it is judged by `outbox_unpublishable`, which stays
-- the one definition (the shortcut only lets through rows it takes, and a
-- refusal keeps its reason), called through `outbox_unpublishable_row`, a
-- PL/pgSQL function the planner never tries to inline, so a statement whose
-- rows all pass the shortcut never parses it. Same names, same exemption of
-- rows the relay has tried, NOT VALID as before.
CREATE FUNCTION outbox_unpublishable_row(p_aggregate_type text, p_event_type text, p_exchange text,
                                         p_routing_key text, p_headers jsonb)
RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $fn$
BEGIN
    RETURN outbox_unpublishable(p_aggregate_type, p_event_type, p_exchange, p_routing_key, p_headers);
END
$fn$;

ALTER TABLE outbox
    DROP CONSTRAINT outbox_names_publishable,
    DROP CONSTRAINT outbox_headers_publishable,
    ADD CONSTRAINT outbox_names_publishable CHECK (
        attempts > 0
        OR (octet_length(event_type) <= 255
            AND octet_length(coalesce(exchange, '')) <= 255
            AND octet_length(coalesce(routing_key, aggregate_type || '.' || event_type)) <= 255)
        OR outbox_unpublishable_row(aggregate_type, event_type, exchange, routing_key, NULL) IS NULL
    ) NOT VALID,
    ADD CONSTRAINT outbox_headers_publishable CHECK (
        attempts > 0
        OR octet_length(headers::text) <= 255
        OR outbox_unpublishable_row('', '', NULL, '', headers) IS NULL
    ) NOT VALID;
