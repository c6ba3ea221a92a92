-- Producer schema, version 11: one definition of "publishable" for the
-- outbox table's CHECKs and for `outbox_emit`, and the write-ahead-log
-- capture's slot recorded per schema, so that no producer writes into a
-- log nobody reads. See docs/OUTBOX_TABLE.md and docs/WAL_CAPTURE.md.

-- Why an event cannot travel as an AMQP message with these names, or NULL
-- when it can. AMQP short strings (exchange, routing key, message type,
-- header names) hold at most 255 bytes; the routing key defaults to
-- `<aggregate_type>.<event_type>`. Nested header objects travel as JSON
-- text, so only top-level header names count. Built-ins only, so the body
-- means the same whatever the caller's search_path.
CREATE FUNCTION outbox_unpublishable(p_aggregate_type text, p_event_type text, p_exchange text,
                                     p_routing_key text, p_headers jsonb)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
    SELECT CASE
        WHEN octet_length(p_event_type) > 255 THEN
            'event_type is ' || octet_length(p_event_type) || ' bytes; AMQP allows at most 255'
        WHEN octet_length(p_exchange) > 255 THEN
            'exchange is ' || octet_length(p_exchange) || ' bytes; AMQP allows at most 255'
        WHEN octet_length(p_routing_key) > 255 THEN
            'routing_key is ' || octet_length(p_routing_key) || ' bytes; AMQP allows at most 255'
        WHEN p_routing_key IS NULL AND octet_length(p_aggregate_type || '.' || p_event_type) > 255 THEN
            'the default routing key (aggregate_type.event_type) is '
            || octet_length(p_aggregate_type || '.' || p_event_type) || ' bytes; AMQP allows at most 255'
        WHEN jsonb_typeof(p_headers) = 'object'
             AND EXISTS (SELECT 1 FROM jsonb_object_keys(p_headers) AS k WHERE octet_length(k) > 255) THEN
            'a header name is over 255 bytes; AMQP allows at most 255'
    END
$fn$;

-- The CHECKs of migration 4, now through that one definition (same names,
-- same rule: a row the relay has already tried is exempt; NOT VALID, so
-- old rows stay and the relay dead-letters or blocks them).
ALTER TABLE outbox
    DROP CONSTRAINT outbox_names_publishable,
    DROP CONSTRAINT outbox_headers_publishable,
    ADD CONSTRAINT outbox_names_publishable CHECK (
        attempts > 0
        OR outbox_unpublishable(aggregate_type, event_type, exchange, routing_key, NULL) IS NULL
    ) NOT VALID,
    ADD CONSTRAINT outbox_headers_publishable CHECK (
        attempts > 0 OR outbox_unpublishable('', '', NULL, '', headers) IS NULL
    ) NOT VALID;

-- The write-ahead-log capture of this schema: the replication slot (and
-- publication, of the same name) that its relays read and that its
-- producers check. One row at most, written by
-- `outbox-relay migrate --capture wal [--slot NAME]`. Slot names are
-- cluster-wide, so two databases with the same schema need two names.
CREATE TABLE outbox_wal_capture (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    slot      text    NOT NULL CHECK (slot ~ '^[a-z_][a-z0-9_]{0,62}$')
);

-- A schema set up before this version reads the slot `outbox_<schema>`.
INSERT INTO outbox_wal_capture (slot)
SELECT s.slot_name FROM pg_replication_slots s
WHERE s.slot_name = 'outbox_' || current_schema() AND s.database = current_database();

-- One row (the slot's name) when an event written to the log now will be
-- read: the schema's slot is recorded, exists in this database and is not
-- invalidated; no row otherwise. The one definition of "readable" that
-- every producer checks with every write, in the same statement: the Rust
-- producers as `WHERE EXISTS (SELECT 1 FROM outbox_wal_readable)` (a
-- one-time filter, a few microseconds), `outbox_emit` through
-- `outbox_wal_ready()`.
CREATE VIEW outbox_wal_readable AS
SELECT c.slot
FROM outbox_wal_capture c
JOIN pg_catalog.pg_replication_slots s
  ON s.slot_name = c.slot AND s.database = pg_catalog.current_database()
WHERE s.wal_status IS DISTINCT FROM 'lost';

-- True when `outbox_wal_readable` has its row. Raises (SQLSTATE 55000)
-- with the reason otherwise, aborting the producer's transaction, so an
-- event that nobody would read never commits. Created with the schema's
-- name written in (no `SET search_path`, which would cost every call a
-- configuration change).
DO $do$
BEGIN
    EXECUTE format($fn$
CREATE FUNCTION %1$I.outbox_wal_ready() RETURNS boolean LANGUAGE plpgsql STABLE AS $body$
DECLARE
    v_slot   text;
    v_status text;
BEGIN
    IF EXISTS (SELECT 1 FROM %1$I.outbox_wal_readable) THEN
        RETURN true;
    END IF;
    SELECT c.slot INTO v_slot FROM %1$I.outbox_wal_capture c;
    IF v_slot IS NULL THEN
        RAISE EXCEPTION 'write-ahead-log capture of schema %%: no replication slot is recorded, so nothing would read this event', %1$L
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Run `outbox-relay migrate --capture wal`, or write events into the outbox table.';
    END IF;
    SELECT coalesce(s.wal_status, 'unknown') INTO v_status
    FROM pg_catalog.pg_replication_slots s
    WHERE s.slot_name = v_slot AND s.database = pg_catalog.current_database();
    IF v_status IS NULL THEN
        RAISE EXCEPTION 'write-ahead-log capture of schema %%: replication slot %% does not exist in this database, so nothing would read this event', %1$L, v_slot
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Run `outbox-relay migrate --capture wal` to create it, or write events into the outbox table.';
    END IF;
    IF v_status IS DISTINCT FROM 'lost' THEN
        -- Readable after all (created this instant).
        RETURN true;
    END IF;
    RAISE EXCEPTION 'write-ahead-log capture of schema %%: replication slot %% was invalidated (wal_status = lost), so nothing would read this event', %1$L, v_slot
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'Recreate the slot (docs/WAL_CAPTURE.md, "a lost slot").';
END
$body$
$fn$, current_schema());
END
$do$;

-- `outbox_emit` of migration 10, now refusing what the table refuses
-- (through `outbox_unpublishable`) and writing only when the slot is
-- there to read it (`outbox_wal_ready`).
CREATE OR REPLACE FUNCTION outbox_emit(p_aggregate_type text, p_aggregate_id text, p_event_type text,
                                       p_payload jsonb, p_headers jsonb DEFAULT '{}'::jsonb,
                                       p_exchange text DEFAULT NULL, p_routing_key text DEFAULT NULL,
                                       p_id uuid DEFAULT NULL)
RETURNS uuid LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $fn$
DECLARE
    v_id  uuid := coalesce(p_id, outbox_uuid_v7());
    v_seq bigint;
    v_why text;
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
    v_why := outbox_unpublishable(p_aggregate_type, p_event_type, p_exchange, p_routing_key, p_headers);
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_emit: %', v_why USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM outbox_wal_readable) THEN
        PERFORM outbox_wal_ready();
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
