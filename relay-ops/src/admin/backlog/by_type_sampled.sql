-- The outbox's events per (aggregate type, event type) from a sample of $1 percent of its
-- pages (float4), scaled to $2, its estimated rows (float8): the 100 largest.
WITH s AS (SELECT aggregate_type, event_type FROM {schema}.outbox TABLESAMPLE SYSTEM ($1)),
     n AS (SELECT greatest(count(*), 1)::float8 AS total FROM s)
SELECT aggregate_type, event_type, round(count(*) * $2 / (SELECT total FROM n))::bigint
FROM s
GROUP BY 1, 2
ORDER BY 3 DESC, 1, 2
LIMIT 100
