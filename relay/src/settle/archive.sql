-- Move delivered events to the archive (`outbox_archive`, partitioned by
-- the day of publication; docs/OUTBOX_TABLE.md). $1 ids.
WITH d AS (DELETE FROM {schema}.outbox WHERE id = ANY($1) RETURNING *)
INSERT INTO {schema}.outbox_archive ({event_columns}, attempts)
SELECT {event_columns}, attempts + 1
FROM d
ON CONFLICT DO NOTHING
