-- Consumer schema, version 3: the inbox partitioned by the event's time,
-- so retention drops a day whole instead of deleting rows. Applied by
-- `outbox_consumer::migrate`, inside one transaction, with search_path set
-- to the configured schema. See docs/INBOX_TABLE.md.
--
-- The dedup key stays unique: a record's partition is a function of its
-- key alone (`inbox_event_time`), so every copy of an event meets the
-- first one's record in the same partition.

-- The time a dedup key carries: the 48-bit millisecond time of a UUIDv7 in
-- its canonical text form (what `Outbox::enqueue` writes), else
-- '-infinity' (natural keys, custom dedup keys, other UUID versions).
CREATE FUNCTION inbox_event_time(key text) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN key ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$'
        THEN timestamptz 'epoch'
             + ('x' || substr(key, 1, 8) || substr(key, 10, 4))::bit(48)::bigint
             * interval '1 millisecond'
        ELSE timestamptz '-infinity'
    END
$$;

-- The records, by the time their key carries. Version 1's table `inbox`
-- stays for consumers of earlier releases still running during an
-- upgrade: its triggers (below) arbitrate their claims here, and the
-- claim of this release also looks there for records written before this
-- migration, until retention has emptied it.
CREATE TABLE inbox_processed (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    event_id     text        NOT NULL CHECK (event_id <> ''),
    -- inbox_event_time(event_id), written by the claim.
    event_at     timestamptz NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id, event_at)
) PARTITION BY RANGE (event_at);

-- The console's processed rates, and chunked retention where a whole day
-- cannot go; on every partition.
CREATE INDEX inbox_processed_processed_at_idx ON inbox_processed (processed_at);

-- A claim of an earlier release (INSERT INTO inbox ... ON CONFLICT DO
-- NOTHING RETURNING event_id) is arbitrated in inbox_processed: a key
-- recorded there already makes the row vanish (a duplicate to that
-- consumer); a fresh one is recorded in both.
CREATE FUNCTION inbox_v1_claim() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO inbox_processed (consumer, event_id, event_at, processed_at)
    VALUES (NEW.consumer, NEW.event_id, inbox_event_time(NEW.event_id), NEW.processed_at)
    ON CONFLICT (consumer, event_id, event_at) DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER inbox_v1_claim BEFORE INSERT ON inbox
    FOR EACH ROW EXECUTE FUNCTION inbox_v1_claim();

-- Its forget (the record of an event whose handler failed) too.
CREATE FUNCTION inbox_v1_forget() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM inbox_processed
    WHERE consumer = OLD.consumer AND event_id = OLD.event_id
      AND event_at = inbox_event_time(OLD.event_id);
    RETURN OLD;
END
$$;
CREATE TRIGGER inbox_v1_forget AFTER DELETE ON inbox
    FOR EACH ROW EXECUTE FUNCTION inbox_v1_forget();

-- Keys that carry no time: retention deletes them by processed_at, in
-- chunks of at most 1,000 rows.
CREATE TABLE inbox_untimed PARTITION OF inbox_processed
    FOR VALUES FROM (MINVALUE) TO ('2000-01-01 00:00:00+00');

-- Times outside the day partitions (an event older than the oldest day
-- kept, or dated after the last day prepared): the same retention.
CREATE TABLE inbox_other PARTITION OF inbox_processed DEFAULT;

-- Copies of events whose handler did not succeed, sent to the retry or
-- dead-letter queue: they may come back at any time, so retention keeps
-- the records they could meet (docs/INBOX_TABLE.md, "Retention").
CREATE TABLE inbox_parked (
    consumer  text        NOT NULL CHECK (consumer <> ''),
    event_id  text        NOT NULL CHECK (event_id <> ''),
    event_at  timestamptz NOT NULL,
    parked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Prepares the day partitions (UTC) from today to `ahead` days later that
-- do not exist yet; returns how many it attached. A day whose events
-- already sit in inbox_other (a producer's clock far ahead) stays there.
-- Attaching locks only inbox_other, never the claims' path.
CREATE FUNCTION inbox_prepare_days(ahead int) RETURNS int
LANGUAGE plpgsql SET search_path FROM CURRENT SET lock_timeout = '100ms' AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    made int := 0;
BEGIN
    -- One caller at a time per schema (consumers start together).
    PERFORM pg_advisory_xact_lock(hashtext(current_schema() || '.inbox_prepare_days'));
    FOR i IN 0 .. ahead LOOP
        day := today + i;
        part := 'inbox_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
            WHERE h.inhparent = 'inbox_processed'::regclass AND c.relname = part);
        BEGIN
            EXECUTE format('CREATE TABLE IF NOT EXISTS %I (LIKE inbox_processed INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
            EXECUTE format(
                'ALTER TABLE inbox_processed ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                part, day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
            made := made + 1;
        EXCEPTION
            WHEN check_violation THEN
                RAISE NOTICE 'inbox: % stays in inbox_other (it holds events of that day)', day;
            WHEN lock_not_available THEN
                RAISE NOTICE 'inbox: % not prepared (inbox_other is busy); next pass', day;
        END;
    END LOOP;
    RETURN made;
END
$$;

-- Drops the day partitions that end at or before `before`; returns their
-- names. A drop that waits over 100 ms for its lock is left for the next
-- pass (and does not hold the claims up longer than that).
CREATE FUNCTION inbox_drop_days(before timestamptz) RETURNS SETOF text
LANGUAGE plpgsql SET search_path FROM CURRENT SET lock_timeout = '100ms' AS $$
DECLARE
    part text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(current_schema() || '.inbox_drop_days'));
    FOR part IN
        SELECT c.relname FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
        WHERE h.inhparent = 'inbox_processed'::regclass AND c.relname ~ '^inbox_p[0-9]{8}$'
          AND (to_date(substr(c.relname, 8), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= before
        ORDER BY c.relname
    LOOP
        BEGIN
            EXECUTE format('DROP TABLE %I', part);
            RETURN NEXT part;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'inbox: % not dropped (busy); next pass', part;
            RETURN;
        END;
    END LOOP;
END
$$;

SELECT inbox_prepare_days(7);
