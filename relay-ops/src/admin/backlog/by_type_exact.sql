-- The outbox's events per (aggregate type, event type), counted: the 100 largest.
-- No parameters.
SELECT aggregate_type, event_type, count(*)
FROM {schema}.outbox
GROUP BY 1, 2
ORDER BY 3 DESC, 1, 2
LIMIT 100
