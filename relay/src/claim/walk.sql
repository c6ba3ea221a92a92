-- One step of a worker's walk over its ordered events (claim/ordered.rs):
-- due ordered events of the partitions this relay leases ($1 relay id) and
-- this worker serves (partition % $2 = $3), in `outbox_ordered_due_idx`'s
-- key order from ($4, $5) on (a null $4 is the index's beginning), at most
-- $6. Nothing is locked: the walk only says which aggregates have due
-- events; the claim (`batch.sql`) reads their heads and chains under the
-- lease rows' locks.
--
-- The walk starts where the last one stopped, so the index entries of
-- events published since, which no vacuum may remove while the xmin
-- horizon is held, are not walked again.
--
-- Every row carries the partitions the worker served at the walk
-- (`held`) and the `now()` that judged what is due (the worker's cursor
-- stays below it); one row comes back even when no event does (with null
-- event columns). The partition test is written `+ 0 = ANY(array)`: with
-- `IN (SELECT ...)` PostgreSQL read every entry of the range before
-- joining.
WITH parts AS MATERIALIZED (
    SELECT coalesce(array_agg(partition), '{}') AS held FROM {schema}.outbox_leases
    WHERE owner = $1 AND expires_at > now() AND partition % $2 = $3)
SELECT parts.held, now() AS now, w.* FROM parts LEFT JOIN LATERAL (
    SELECT o.available_at, o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq
    FROM {schema}.outbox o
    WHERE o.aggregate_seq IS NOT NULL AND o.available_at <= now()
      AND (o.available_at, o.id) >= (coalesce($4::timestamptz, '-infinity'), $5::uuid)
      AND {schema}.outbox_partition(o.aggregate_type, o.aggregate_id) + 0 = ANY(parts.held)
      AND cardinality(parts.held) > 0
    ORDER BY o.available_at, o.id
    LIMIT $6) w ON true
