-- Record the keys $2 (sorted) of consumer $1; return those not seen
-- before. Records from before migration 3 are looked up in version 1's
-- `inbox`.
INSERT INTO {schema}.inbox_processed (consumer, event_id, event_at)
SELECT $1, k, {schema}.inbox_event_time(k) FROM unnest($2::text[]) AS k
WHERE NOT EXISTS (SELECT 1 FROM {schema}.inbox o WHERE o.consumer = $1 AND o.event_id = k)
ON CONFLICT (consumer, event_id, event_at) DO NOTHING
RETURNING event_id
