-- Events each consumer processed in the last minute, by consumer name ({inbox}: the
-- consumers' inbox schema; an index range on processed_at). No parameters.
SELECT consumer, count(*)
FROM {inbox}.inbox_processed
WHERE processed_at >= now() - interval '1 minute'
GROUP BY consumer
ORDER BY consumer
