-- Producer schema, version 16: the archive (`--archive`) partitioned by the
-- day it was published, so that the relay's retention drops a day whole
-- instead of deleting rows (docs/OUTBOX_TABLE.md, "outbox_archive").
--
-- Version 1's `outbox_published` stays: relays of earlier versions still
-- running during an upgrade keep archiving there, readers (the console's
-- reconciliation) read both, and the relay's retention empties it, at
-- most 1,000 rows a statement, as its rows pass the window.

CREATE TABLE outbox_archive (
    id             uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    exchange       text,
    routing_key    text,
    created_at     timestamptz NOT NULL,
    aggregate_seq  bigint,
    attempts       integer     NOT NULL,
    published_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id, published_at)
) PARTITION BY RANGE (published_at);

-- Windows of publication (the console's reconciliation, an operator's
-- question "what went out between ..."): on every partition.
CREATE INDEX outbox_archive_published_at_idx ON outbox_archive (published_at);

-- Rows outside the days prepared (the relay's upkeep stopped for more than
-- the days ahead): retention deletes them in chunks.
CREATE TABLE outbox_archive_other PARTITION OF outbox_archive DEFAULT;

-- Prepares the day partitions (UTC) from today to `ahead` days later that
-- do not exist yet; returns how many it attached. Attaching locks only
-- outbox_archive_other, never the relay's inserts.
CREATE FUNCTION outbox_archive_prepare_days(ahead int) RETURNS int
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET lock_timeout = '100ms' AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    made int := 0;
BEGIN
    -- One caller at a time per schema (relays start together).
    PERFORM pg_advisory_xact_lock(hashtext(current_schema() || '.outbox_archive_prepare_days'));
    FOR i IN 0 .. ahead LOOP
        day := today + i;
        part := 'outbox_archive_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
            WHERE h.inhparent = 'outbox_archive'::regclass AND c.relname = part);
        BEGIN
            EXECUTE format('CREATE TABLE IF NOT EXISTS %I (LIKE outbox_archive INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
            EXECUTE format(
                'ALTER TABLE outbox_archive ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                part, day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
            made := made + 1;
        EXCEPTION
            WHEN check_violation THEN
                RAISE NOTICE 'outbox_archive: % stays in outbox_archive_other (it holds rows of that day)', day;
            WHEN lock_not_available THEN
                RAISE NOTICE 'outbox_archive: % not prepared (busy); next pass', day;
        END;
    END LOOP;
    RETURN made;
END
$$;

-- Drops the day partitions that end at or before `before`; returns their
-- names. A drop that waits over 100 ms for its lock is left for the next
-- pass (and holds the relay's inserts up no longer than that).
CREATE FUNCTION outbox_archive_drop_days(before timestamptz) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET lock_timeout = '100ms' AS $$
DECLARE
    part text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(current_schema() || '.outbox_archive_drop_days'));
    FOR part IN
        SELECT c.relname FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
        WHERE h.inhparent = 'outbox_archive'::regclass AND c.relname ~ '^outbox_archive_p[0-9]{8}$'
          AND (to_date(substr(c.relname, 17), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= before
        ORDER BY c.relname
    LOOP
        BEGIN
            EXECUTE format('DROP TABLE %I', part);
            RETURN NEXT part;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'outbox_archive: % not dropped (busy); next pass', part;
            RETURN;
        END;
    END LOOP;
END
$$;

-- Both run with the rights of the migration's role (the table's owner), so
-- the relay's role needs no ownership; only the roles granted EXECUTE may
-- call them (docs/OPERATIONS.md, "Roles").
REVOKE EXECUTE ON FUNCTION outbox_archive_prepare_days(int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_archive_drop_days(timestamptz) FROM PUBLIC;

SELECT outbox_archive_prepare_days(7);
