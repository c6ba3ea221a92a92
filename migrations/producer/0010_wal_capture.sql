-- Producer schema, version 10: the write-ahead-log capture path
-- (docs/WAL_CAPTURE.md).
--
-- `outbox_emit` writes one event as a transactional logical decoding
-- message instead of an outbox row: it is decoded (and published by a relay
-- running `--capture wal`) only if the calling transaction commits, in
-- commit order. Nothing is stored in a table. Without a replication slot
-- the message is written to the WAL and never read: `outbox-relay migrate
-- --capture wal` creates the slot, and the libraries refuse the mode
-- without it.
--
-- The message's prefix is `outbox:<schema>`; its content is one JSON
-- object, the contract documented in docs/WAL_CAPTURE.md:
--   {"v": 1, "id", "aggregate_type", "aggregate_id", "event_type",
--    "payload", "headers", "exchange", "routing_key", "aggregate_seq",
--    "created_at"}
-- An event of an ordered aggregate type takes the next number of its
-- aggregate from `outbox_sequences`, as an outbox row would.
--
-- Arguments follow the outbox table's columns and its rules (non-empty
-- aggregate type, aggregate id and event type; headers a JSON object);
-- `p_id` NULL takes a new UUIDv7. Returns the event id. Unlike an insert,
-- an id emitted twice is published twice (consumers absorb duplicates).
CREATE FUNCTION outbox_emit(p_aggregate_type text, p_aggregate_id text, p_event_type text,
                            p_payload jsonb, p_headers jsonb DEFAULT '{}'::jsonb,
                            p_exchange text DEFAULT NULL, p_routing_key text DEFAULT NULL,
                            p_id uuid DEFAULT NULL)
RETURNS uuid LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $fn$
DECLARE
    v_id  uuid := coalesce(p_id, outbox_uuid_v7());
    v_seq bigint;
BEGIN
    IF coalesce(p_aggregate_type, '') = '' OR coalesce(p_aggregate_id, '') = ''
       OR coalesce(p_event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id and event_type must not be empty'
            USING ERRCODE = 'check_violation';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: payload must not be NULL (use ''null''::jsonb for a JSON null)'
            USING ERRCODE = 'not_null_violation';
    END IF;
    IF jsonb_typeof(coalesce(p_headers, '{}'::jsonb)) <> 'object' THEN
        RAISE EXCEPTION 'outbox_emit: headers must be a JSON object'
            USING ERRCODE = 'check_violation';
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_ordered_types t
               WHERE t.aggregate_type IN (p_aggregate_type, '*')) THEN
        v_seq := outbox_next_seq(p_aggregate_type, p_aggregate_id);
    END IF;
    PERFORM pg_logical_emit_message(true, 'outbox:' || current_schema(),
        json_build_object(
            'v', 1,
            'id', v_id,
            'aggregate_type', p_aggregate_type,
            'aggregate_id', p_aggregate_id,
            'event_type', p_event_type,
            'payload', p_payload,
            'headers', coalesce(p_headers, '{}'::jsonb),
            'exchange', p_exchange,
            'routing_key', p_routing_key,
            'aggregate_seq', v_seq,
            'created_at', now())::text);
    RETURN v_id;
END
$fn$;
