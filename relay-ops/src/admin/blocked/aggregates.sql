-- Blocked aggregates' failing heads, oldest first, each with the events waiting behind it
-- (counted up to {waiting_counted_up_to}). $1 how many aggregates.
SELECT o.aggregate_type, o.aggregate_id, o.id AS event_id, o.aggregate_seq, o.attempts,
       o.last_error, o.available_at AS next_attempt_at,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.outbox w
        WHERE w.aggregate_type = o.aggregate_type AND w.aggregate_id = o.aggregate_id
          AND w.aggregate_seq > o.aggregate_seq LIMIT {waiting_counted_up_to}) x) AS waiting
FROM {schema}.outbox o {blocked_heads}
ORDER BY o.created_at
LIMIT $1
