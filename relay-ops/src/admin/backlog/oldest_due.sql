-- The unordered events due first, in the relay's claim order (the claim index).
-- $1 how many.
SELECT id, aggregate_type, aggregate_id, event_type, attempts, created_at, available_at,
       last_error
FROM {schema}.outbox
WHERE aggregate_seq IS NULL
ORDER BY available_at, id
LIMIT $1
