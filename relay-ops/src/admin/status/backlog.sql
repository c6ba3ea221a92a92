-- The outbox at a glance: its events, those due now, the oldest one's age in seconds, and
-- those that failed at least once. No parameters.
SELECT count(*),
       count(*) FILTER (WHERE available_at <= now()),
       extract(epoch FROM now() - min(created_at))::float8,
       count(*) FILTER (WHERE attempts > 0)
FROM {schema}.outbox
