-- One batch, claimed in one statement (one round trip to the database).
--
-- First, ordered events of the partitions this relay leases ($1 relay id)
-- and this worker serves (partition % $2 = $3): the due heads of up to $4
-- aggregates per partition, in key order after the worker's cursor ($5
-- partitions, $6 types, $7 ids), looking at $9 aggregates per partition at
-- most, and the events after each due head, at most about $8 in all. Heads
-- not due come back alone with `due` false (they only move the cursor).
-- The lease rows are held FOR KEY SHARE until the transaction ends, so no
-- lease changes owner under a batch in flight (renewals go through).
-- While the outbox holds no ordered event at all (`probe`: one look into a
-- partial index, evaluated once), no partition is looked at and no lease
-- locked: walking every partition's heads cost a millisecond a claim for
-- nothing. (A worker that knows none is waiting claims with
-- `unordered.sql` instead, which plans none of this.)
--
-- Then due unordered events, oldest first, skipping rows other relays
-- hold: the room the ordered events sent left in the batch of $8 (a head
-- being retried is sent alone, so the chain read behind it takes no
-- room), and a quarter of it at least, so a large ordered backlog cannot
-- hold them up. They start at the worker's cursor, ($10, $11) in the
-- index's key order, as in `unordered.sql`.
--
-- Ordered rows carry their head's place in the claim (`ord`) and their
-- partition; unordered ones carry neither. Nothing is sorted here (a sort
-- of the whole batch cost PostgreSQL more than the round trip it saved):
-- the relay puts the ordered rows in chain order, (`ord`, `aggregate_seq`).
-- Every row carries the probe's answer (`ordered_waiting`), and one row
-- comes back even when nothing is claimed (then with null event columns),
-- so the worker learns when to go back to `unordered.sql`.
WITH probe AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.aggregate_seq IS NOT NULL) AS ordered_waiting),
parts AS (
    SELECT partition FROM {schema}.outbox_leases
    WHERE owner = $1 AND expires_at > now() AND partition % $2 = $3
      AND (SELECT ordered_waiting FROM probe)
    FOR KEY SHARE),
cursor AS (SELECT * FROM unnest($5::int[], $6::text[], $7::text[]) AS c(partition, t, a)),
heads AS MATERIALIZED (
    SELECT parts.partition, h.*, row_number() OVER () AS ord
    FROM parts LEFT JOIN cursor USING (partition)
    CROSS JOIN LATERAL {schema}.outbox_heads(
        parts.partition, coalesce(cursor.t, ''), coalesce(cursor.a, ''), $4, $9) h),
chain AS (SELECT greatest(1, $8 / greatest(count(*) FILTER (WHERE due), 1)) AS n FROM heads),
ordered AS MATERIALIZED (
    SELECT r.*, heads.due AND r.available_at <= now() AS due, heads.partition, heads.ord
    FROM heads CROSS JOIN chain CROSS JOIN LATERAL (
        SELECT {claimed_columns}, available_at FROM {schema}.outbox x
        WHERE x.aggregate_type = heads.aggregate_type AND x.aggregate_id = heads.aggregate_id
          AND x.aggregate_seq >= heads.aggregate_seq
        ORDER BY x.aggregate_seq
        LIMIT CASE WHEN heads.due THEN chain.n ELSE 1 END) r),
claimed AS (
  SELECT * FROM ordered
  UNION ALL
  SELECT * FROM (
    SELECT {claimed_columns}, available_at, true AS due, NULL::int AS partition, NULL::bigint AS ord
    FROM {schema}.outbox
    WHERE available_at <= now() AND aggregate_seq IS NULL
      AND (available_at, id) >= (coalesce($10::timestamptz, '-infinity'), $11::uuid)
    ORDER BY available_at, id
    LIMIT greatest($8 - (
        -- What the relay sends of the chains: a head being retried goes
        -- alone, whatever was read behind it.
        SELECT count(*) FROM ordered o
        JOIN heads h ON h.ord = o.ord
        JOIN ordered head ON head.id = h.id
        WHERE o.due AND (o.id = h.id OR head.attempts = 0)), ($8 + 3) / 4)
    FOR UPDATE SKIP LOCKED) unordered)
SELECT probe.ordered_waiting, claimed.* FROM probe LEFT JOIN claimed ON true
