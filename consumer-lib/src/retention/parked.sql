-- The parked copies of every consumer name: how many, the oldest event
-- time among them and the oldest park.
SELECT count(*), min(event_at) FILTER (WHERE event_at > '-infinity'), min(parked_at)
FROM {schema}.inbox_parked
