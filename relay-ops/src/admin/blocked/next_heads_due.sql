-- Makes due from the clock the new head of each ordered aggregate of the skipped events $1
-- (ids, now dead letters), when it was due already.
UPDATE {schema}.outbox o SET available_at = clock_timestamp()
FROM (SELECT DISTINCT aggregate_type, aggregate_id FROM {schema}.outbox_dead_letters
      WHERE id = ANY($1) AND aggregate_seq IS NOT NULL) d
CROSS JOIN LATERAL (
    SELECT x.id FROM {schema}.outbox x
    WHERE x.aggregate_type = d.aggregate_type AND x.aggregate_id = d.aggregate_id
      AND x.aggregate_seq IS NOT NULL
    ORDER BY x.aggregate_seq LIMIT 1) n
WHERE o.id = n.id AND o.available_at <= now()
