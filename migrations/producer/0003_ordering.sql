-- Producer schema, version 3: per-aggregate ordering (docs/ORDERING.md).
-- Runs with search_path set to the target schema.
--
-- An ordered event carries `aggregate_seq`: its position in its aggregate,
-- 1, 2, 3, ... in commit order. Producers take the next number from
-- `outbox_sequences` with a row lock held until their commit, so two
-- transactions writing events of one aggregate are serialised there and the
-- numbers follow commit order. Unordered events leave it NULL.
--
-- On a large existing outbox the index changes below rewrite indexes under
-- a lock: run this migration when the backlog is small.

ALTER TABLE outbox ADD COLUMN aggregate_seq bigint CHECK (aggregate_seq >= 1);
ALTER TABLE outbox_dead_letters ADD COLUMN aggregate_seq bigint;
ALTER TABLE outbox_published ADD COLUMN aggregate_seq bigint;

-- The partition of an aggregate: relays lease partitions, and one partition
-- has one publisher at a time. 64 partitions, fixed: every relay must agree.
CREATE FUNCTION outbox_partition(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
    SELECT (hashtextextended(aggregate_type || '/' || aggregate_id, 0) & 63)::integer
$fn$;

-- Unordered events are claimed oldest first with SKIP LOCKED, as before.
DROP INDEX outbox_due_idx;
CREATE INDEX outbox_due_idx ON outbox (available_at, id) WHERE aggregate_seq IS NULL;
-- Ordered events: at most one row per (aggregate, seq).
CREATE UNIQUE INDEX outbox_aggregate_seq_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_seq IS NOT NULL;
-- A relay walks the aggregates of a partition in key order, one index
-- descent per aggregate (see outbox_heads).
CREATE INDEX outbox_ordered_idx
    ON outbox (outbox_partition(aggregate_type, aggregate_id), aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_seq IS NOT NULL;

-- Heads in key order strictly after (p_after_type, p_after_id): each row is
-- one aggregate's head and whether it is due. The walk stops after p_limit
-- due heads or p_scan heads in all, so aggregates that are backing off cost
-- at most p_scan index descents per call, however many there are.
CREATE FUNCTION outbox_heads_from(p_partition integer, p_after_type text, p_after_id text,
                                  p_limit integer, p_scan integer)
RETURNS TABLE (aggregate_type text, aggregate_id text, aggregate_seq bigint, available_at timestamptz,
               id uuid, due boolean)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $fn$
BEGIN
    RETURN QUERY
    WITH RECURSIVE h AS (
        (SELECT o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.available_at, o.id,
                o.available_at <= now() AS due, 1 AS steps, (o.available_at <= now())::int AS dues
         FROM outbox o
         WHERE outbox_partition(o.aggregate_type, o.aggregate_id) = p_partition
           AND o.aggregate_seq IS NOT NULL
           AND (o.aggregate_type, o.aggregate_id) > (p_after_type, p_after_id)
         ORDER BY outbox_partition(o.aggregate_type, o.aggregate_id), o.aggregate_type, o.aggregate_id, o.aggregate_seq
         LIMIT 1)
        UNION ALL
        SELECT n.aggregate_type, n.aggregate_id, n.aggregate_seq, n.available_at, n.id,
               n.available_at <= now(), h.steps + 1, h.dues + (n.available_at <= now())::int
        FROM h CROSS JOIN LATERAL (
            SELECT o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.available_at, o.id
            FROM outbox o
            WHERE outbox_partition(o.aggregate_type, o.aggregate_id) = p_partition
              AND o.aggregate_seq IS NOT NULL
              AND (o.aggregate_type, o.aggregate_id) > (h.aggregate_type, h.aggregate_id)
            ORDER BY outbox_partition(o.aggregate_type, o.aggregate_id), o.aggregate_type, o.aggregate_id, o.aggregate_seq
            LIMIT 1) n
        WHERE h.steps < p_scan AND h.dues < p_limit
    )
    SELECT h.aggregate_type, h.aggregate_id, h.aggregate_seq, h.available_at, h.id, h.due FROM h;
END
$fn$;

-- The heads of a partition in key order starting after (p_after_type,
-- p_after_id) and wrapping around to the start, up to p_limit due ones or
-- p_scan in all (due or not). Relays pass the last key they got, so every
-- aggregate gets its turn.
CREATE FUNCTION outbox_heads(p_partition integer, p_after_type text, p_after_id text,
                             p_limit integer, p_scan integer)
RETURNS TABLE (aggregate_type text, aggregate_id text, aggregate_seq bigint, available_at timestamptz,
               id uuid, due boolean)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $fn$
DECLARE
    r     record;
    steps integer := 0;
    dues  integer := 0;
BEGIN
    FOR r IN SELECT * FROM outbox_heads_from(p_partition, p_after_type, p_after_id, p_limit, p_scan) LOOP
        steps := steps + 1;
        dues := dues + r.due::int;
        aggregate_type := r.aggregate_type; aggregate_id := r.aggregate_id;
        aggregate_seq := r.aggregate_seq; available_at := r.available_at; id := r.id; due := r.due;
        RETURN NEXT;
    END LOOP;
    IF dues < p_limit AND steps < p_scan AND p_after_type <> '' THEN
        FOR r IN SELECT * FROM outbox_heads_from(p_partition, '', '', p_limit - dues, p_scan - steps) w
                 WHERE (w.aggregate_type, w.aggregate_id) <= (p_after_type, p_after_id) LOOP
            aggregate_type := r.aggregate_type; aggregate_id := r.aggregate_id;
            aggregate_seq := r.aggregate_seq; available_at := r.available_at; id := r.id; due := r.due;
            RETURN NEXT;
        END LOOP;
    END IF;
END
$fn$;

-- The last sequence number handed out per aggregate. Only ever grows;
-- a rolled-back transaction rolls its increment back with it.
CREATE TABLE outbox_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL CHECK (last_seq >= 0),
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- For producers in other languages: reserves `n` numbers for an aggregate
-- and returns the last one (the range is last-n+1 .. last). Call it in the
-- transaction that inserts the events.
CREATE FUNCTION outbox_next_seq(p_aggregate_type text, p_aggregate_id text, p_n bigint DEFAULT 1)
RETURNS bigint LANGUAGE sql VOLATILE SET search_path FROM CURRENT AS $fn$
    INSERT INTO outbox_sequences AS q (aggregate_type, aggregate_id, last_seq)
    VALUES (p_aggregate_type, p_aggregate_id, p_n)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = q.last_seq + EXCLUDED.last_seq
    RETURNING last_seq
$fn$;

-- Live relays, by heartbeat.
CREATE TABLE outbox_relays (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- One row per partition. A relay publishes a partition's ordered events
-- only inside a transaction that holds its lease row FOR KEY SHARE, so a
-- lease cannot change hands while a batch of it is in flight. `owner` is
-- part of a unique key on purpose: changing it is a key update, which waits
-- for those locks, while renewing `expires_at` does not.
CREATE TABLE outbox_leases (
    partition  integer     PRIMARY KEY CHECK (partition BETWEEN 0 AND 63),
    owner      uuid,
    owner_name text,
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    UNIQUE (partition, owner)
);
INSERT INTO outbox_leases (partition) SELECT generate_series(0, 63);

-- One lease round of relay `p_relay`: heartbeat, renew its leases, give up
-- partitions above its fair share (64 / live relays, rounded up), take free
-- or expired ones below it. Returns the partitions it holds afterwards.
CREATE FUNCTION outbox_lease_tick(p_relay uuid, p_name text, p_ttl interval)
RETURNS SETOF integer LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT SET lock_timeout = '5s' AS $fn$
DECLARE
    live  integer;
    share integer;
    mine  integer;
BEGIN
    INSERT INTO outbox_relays AS r (id, name) VALUES (p_relay, p_name)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now();
    DELETE FROM outbox_relays WHERE heartbeat_at < now() - p_ttl * 10;
    SELECT count(*) INTO live FROM outbox_relays WHERE heartbeat_at > now() - p_ttl;
    share := ceil(64.0 / greatest(live, 1));
    UPDATE outbox_leases SET expires_at = now() + p_ttl WHERE owner = p_relay;
    SELECT count(*) INTO mine FROM outbox_leases WHERE owner = p_relay;
    IF mine > share THEN
        UPDATE outbox_leases SET owner = NULL, owner_name = NULL, expires_at = '-infinity'
        WHERE partition IN (SELECT partition FROM outbox_leases WHERE owner = p_relay
                            ORDER BY partition DESC LIMIT mine - share);
    ELSIF mine < share THEN
        UPDATE outbox_leases SET owner = p_relay, owner_name = p_name, expires_at = now() + p_ttl
        WHERE partition IN (SELECT partition FROM outbox_leases
                            WHERE owner IS NULL OR expires_at <= now()
                            ORDER BY partition LIMIT share - mine
                            FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN QUERY SELECT l.partition FROM outbox_leases l WHERE l.owner = p_relay ORDER BY 1;
END
$fn$;
