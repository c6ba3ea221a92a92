-- The missing events (reconcile/missing.sql: $1 consumer, $2 and $3 the window, $4 the
-- routing key's pattern) as the page lists them: the first {listed}, each with the count of all.
SELECT p.id, p.published_at, p.aggregate_type, p.aggregate_id, p.event_type,
       count(*) OVER () AS total
{missing}
ORDER BY p.published_at, p.id
LIMIT {listed}
