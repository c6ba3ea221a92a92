-- Forget the records of keys $2 of consumer $1 (their handler did not
-- succeed) and park them: a copy of each is on its way to the retry or
-- dead-letter queue.
WITH gone AS (
    DELETE FROM {schema}.inbox_processed WHERE consumer = $1 AND event_id = ANY($2::text[])
)
INSERT INTO {schema}.inbox_parked (consumer, event_id, event_at)
SELECT $1, k, {schema}.inbox_event_time(k) FROM unnest($2::text[]) AS k
ON CONFLICT (consumer, event_id) DO UPDATE SET parked_at = now()
