-- One batch, claimed in one statement (one round trip to the database).
--
-- First, ordered events: the chains of the aggregates the worker asks for
-- ($4 types, $5 ids, in its order; claim/ordered.rs queues them from its
-- walk, `walk.sql`), if their partitions are leased by this relay ($1
-- relay id) and served by this worker (partition % $2 = $3). Each
-- aggregate's head is its lowest sequence number above $6 (the last one
-- the worker knows to be gone from the outbox: the head is found in one
-- index descent, not by stepping over the entries of its published
-- events, which no vacuum may remove while the xmin horizon is held).
-- Behind each due head come its next events, about $7 in all; a head
-- not due comes back alone with `due` false. The lease rows are held FOR
-- KEY SHARE until the transaction ends, so no lease changes owner under a
-- batch in flight (renewals go through); with no aggregate asked for,
-- none is locked.
--
-- Then due unordered events, oldest first, skipping rows other relays
-- hold: the room the ordered events sent left in the batch of $7 (a head
-- being retried is sent alone, so the chain read behind it takes no
-- room), and a quarter of it at least, so a large ordered backlog cannot
-- hold them up. They start at the relay's cursor, ($8, $9) in the
-- index's key order, as in `unordered.sql`.
--
-- Ordered rows carry their aggregate's place in the request (`ord`) and
-- their partition; unordered ones carry neither. Nothing is sorted here
-- (a sort of the whole batch cost PostgreSQL more than the round trip it
-- saved): the relay puts the ordered rows in chain order, (`ord`,
-- `aggregate_seq`). Every row carries the probe's answer
-- (`ordered_waiting`: an ordered event at or after the worker's walk
-- cursor, ($10, $11), due or not) and the partitions the worker served
-- (`held`, empty when it asked for no aggregate), and one row comes back
-- even when nothing is claimed (then with null event columns), so the
-- worker learns when to go back to `unordered.sql`.
WITH probe AS MATERIALIZED (
    SELECT EXISTS (
        SELECT 1 FROM {schema}.outbox o
        WHERE o.aggregate_seq IS NOT NULL
          AND (o.available_at, o.id) >= (coalesce($10::timestamptz, '-infinity'), $11::uuid)
    ) AS ordered_waiting),
parts AS (
    SELECT partition FROM {schema}.outbox_leases
    WHERE owner = $1 AND expires_at > now() AND partition % $2 = $3
      AND cardinality($4::text[]) > 0
    FOR KEY SHARE),
wanted AS (
    SELECT * FROM unnest($4::text[], $5::text[], $6::int8[]) WITH ORDINALITY AS w(t, a, after, ord)),
heads AS MATERIALIZED (
    SELECT w.ord, h.* FROM wanted w CROSS JOIN LATERAL (
        SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.available_at <= now() AS due,
               {schema}.outbox_partition(o.aggregate_type, o.aggregate_id) AS partition
        FROM {schema}.outbox o
        WHERE o.aggregate_type = w.t AND o.aggregate_id = w.a
          AND o.aggregate_seq IS NOT NULL AND o.aggregate_seq > w.after
        ORDER BY o.aggregate_seq
        LIMIT 1) h
    WHERE h.partition IN (SELECT partition FROM parts)),
chain AS (SELECT greatest(1, $7 / greatest(count(*) FILTER (WHERE due), 1)) AS n FROM heads),
ordered AS MATERIALIZED (
    SELECT r.*, heads.due AND r.available_at <= now() AS due, heads.partition, heads.ord
    FROM heads CROSS JOIN chain CROSS JOIN LATERAL (
        SELECT {row_columns}, available_at FROM {schema}.outbox x
        WHERE x.aggregate_type = heads.aggregate_type AND x.aggregate_id = heads.aggregate_id
          AND x.aggregate_seq IS NOT NULL AND x.aggregate_seq >= heads.aggregate_seq
        ORDER BY x.aggregate_seq
        LIMIT CASE WHEN heads.due THEN chain.n ELSE 1 END) r),
claimed AS (
  SELECT * FROM ordered
  UNION ALL
  SELECT * FROM (
    SELECT {row_columns}, available_at, true AS due, NULL::int AS partition, NULL::bigint AS ord
    FROM {schema}.outbox
    WHERE available_at <= now() AND aggregate_seq IS NULL
      AND (available_at, id) >= (coalesce($8::timestamptz, '-infinity'), $9::uuid)
    ORDER BY available_at, id
    LIMIT greatest($7 - (
        -- What the relay sends of the chains: a head being retried goes
        -- alone, whatever was read behind it.
        SELECT count(*) FROM ordered o
        JOIN heads h ON h.ord = o.ord
        JOIN ordered head ON head.id = h.id
        WHERE o.due AND (o.id = h.id OR head.attempts = 0)), ($7 + 3) / 4)
    FOR UPDATE SKIP LOCKED) unordered)
SELECT probe.ordered_waiting, (SELECT coalesce(array_agg(partition), '{}') FROM parts) AS held, claimed.*
FROM probe LEFT JOIN claimed ON true
