-- Move delivered events to outbox_published. $1 ids.
WITH d AS (DELETE FROM {schema}.outbox WHERE id = ANY($1) RETURNING *)
INSERT INTO {schema}.outbox_published ({event_columns}, attempts)
SELECT {event_columns}, attempts + 1
FROM d
ON CONFLICT (id) DO NOTHING
