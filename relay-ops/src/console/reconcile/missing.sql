-- A fragment, from FROM on: the published events (archive and version 1's outbox_published,
-- in {schema}) of the window [$2, $3) whose routing key matches $4 (NULL: any) with no inbox
-- row (in {inbox}) for consumer $1.
FROM (
    SELECT id, published_at, aggregate_type, aggregate_id, event_type, payload, headers,
           exchange, routing_key, created_at, attempts, aggregate_seq
    FROM {schema}.outbox_archive
    UNION ALL
    SELECT id, published_at, aggregate_type, aggregate_id, event_type, payload, headers,
           exchange, routing_key, created_at, attempts, aggregate_seq
    FROM {schema}.outbox_published) p
WHERE p.published_at >= $2 AND p.published_at < $3
  AND ($4::text IS NULL
       OR coalesce(p.routing_key, p.aggregate_type || '.' || p.event_type) ~ $4)
  AND NOT EXISTS (SELECT 1 FROM {inbox}.inbox_processed i
                  WHERE i.consumer = $1 AND i.event_id = p.id::text
                    AND i.event_at = {inbox}.inbox_event_time(p.id::text))
  AND NOT EXISTS (SELECT 1 FROM {inbox}.inbox o
                  WHERE o.consumer = $1 AND o.event_id = p.id::text)
