-- Producer schema, version 6: which aggregate types are ordered is a
-- property of the data, known to the database and enforced for every
-- writer (the Rust library, SQL, other languages).
--
-- Before, each producer handle said which types it numbered: a handle
-- without that setting (a rolling deploy, a script, another language)
-- wrote unnumbered events of an ordered type, and ordered consumers
-- applied them at once, out of order. Now a row in outbox_ordered_types
-- makes every insert of that type take the next number of its aggregate,
-- whoever inserts. See docs/ORDERING.md.

-- The ordered aggregate types; '*' orders every type.
CREATE TABLE outbox_ordered_types (
    aggregate_type text        PRIMARY KEY CHECK (aggregate_type <> ''),
    since          timestamptz NOT NULL DEFAULT now()
);

-- Numbers an event of an ordered type that arrives without a number. The
-- counter's row lock is taken first, so the check below sees any earlier
-- insert of the same id for the same aggregate: an id already in the
-- outbox (the insert will conflict) gives its number back, leaving no hole.
CREATE FUNCTION outbox_number_ordered() RETURNS trigger
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $fn$
DECLARE
    n bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox_ordered_types t
                   WHERE t.aggregate_type IN (NEW.aggregate_type, '*')) THEN
        RETURN NEW;
    END IF;
    INSERT INTO outbox_sequences AS q (aggregate_type, aggregate_id, last_seq)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = q.last_seq + 1
    RETURNING last_seq INTO n;
    IF EXISTS (SELECT 1 FROM outbox o WHERE o.id = NEW.id) THEN
        UPDATE outbox_sequences SET last_seq = last_seq - 1
        WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id;
        RETURN NEW;
    END IF;
    NEW.aggregate_seq := n;
    RETURN NEW;
END
$fn$;

-- Orders (or stops ordering) one aggregate type. The numbering trigger
-- exists only while some type is ordered, so outboxes without ordering pay
-- nothing for it. Needs the rights of the schema's owner (it may create or
-- drop the trigger, which locks the outbox briefly: it gives up after 5 s
-- rather than stall producers behind a long transaction);
-- `outbox-relay ordering add|remove` calls it.
CREATE FUNCTION outbox_set_ordered(p_aggregate_type text, p_ordered boolean) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT SET lock_timeout = '5s' AS $fn$
BEGIN
    -- One at a time per database: two callers must not both create the
    -- trigger. (Any key, the same everywhere: "outbox-o" in ASCII.)
    PERFORM pg_advisory_xact_lock(8031453476610911599);
    IF p_ordered THEN
        INSERT INTO outbox_ordered_types (aggregate_type) VALUES (p_aggregate_type)
        ON CONFLICT (aggregate_type) DO NOTHING;
    ELSE
        DELETE FROM outbox_ordered_types WHERE aggregate_type = p_aggregate_type;
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_ordered_types) THEN
        IF NOT EXISTS (SELECT 1 FROM pg_trigger
                       WHERE tgrelid = 'outbox'::regclass AND tgname = 'outbox_number_ordered') THEN
            CREATE TRIGGER outbox_number_ordered BEFORE INSERT ON outbox
            FOR EACH ROW WHEN (NEW.aggregate_seq IS NULL)
            EXECUTE FUNCTION outbox_number_ordered();
        END IF;
    ELSE
        DROP TRIGGER IF EXISTS outbox_number_ordered ON outbox;
    END IF;
END
$fn$;
