-- The rows PostgreSQL estimates the day partitions of inbox_processed
-- ending at or before $1 hold (read before they are dropped: a dropped
-- table has no statistics left).
SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint
FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
WHERE h.inhparent = '{schema}.inbox_processed'::regclass AND c.relname ~ '^inbox_p[0-9]{8}$'
  AND (to_date(substr(c.relname, 8), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= $1
