-- The claim while the outbox holds no ordered event (one round trip, as
-- `batch.sql`): due unordered events, oldest first, skipping rows other
-- relays hold, at most $1. None of `batch.sql`'s ordered part is planned,
-- started or locked here: with it, a claim took 0.37 ms instead of 0.21
-- (medians, sqlx's own timings, no ordered event in the outbox).
--
-- The same probe as `batch.sql` (one look into `outbox_ordered_due_idx`
-- from the worker's walk cursor, ($4, $5)) says whether ordered events are
-- waiting: the worker then claims with `batch.sql` until its probe finds
-- none. The probe's row comes back even
-- when nothing is claimed (then with null event columns), so the answer
-- is never lost.
--
-- The claim starts at the worker's cursor, ($2, $3) in the index's key
-- order (floor.rs says why, and why no row that can still be claimed lies
-- below it): the drained part of the index, whose entries no vacuum may
-- remove while the xmin horizon is held, is not walked again. A null $2
-- is the index's beginning.
WITH probe AS MATERIALIZED (
    SELECT EXISTS (
        SELECT 1 FROM {schema}.outbox o
        WHERE o.aggregate_seq IS NOT NULL
          AND (o.available_at, o.id) >= (coalesce($4::timestamptz, '-infinity'), $5::uuid)
    ) AS ordered_waiting),
claimed AS (
    SELECT {row_columns}, available_at, true AS due, NULL::int AS partition, NULL::bigint AS ord
    FROM {schema}.outbox
    WHERE available_at <= now() AND aggregate_seq IS NULL
      AND (available_at, id) >= (coalesce($2::timestamptz, '-infinity'), $3::uuid)
    ORDER BY available_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED)
SELECT probe.ordered_waiting, claimed.* FROM probe LEFT JOIN claimed ON true
