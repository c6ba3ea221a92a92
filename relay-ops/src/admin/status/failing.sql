-- The 10 retrying events with the most attempts (then the next due first). No parameters.
SELECT id, event_type, exchange, routing_key, attempts, last_error,
       available_at AS next_attempt_at
FROM {schema}.outbox
WHERE attempts > 0
ORDER BY attempts DESC, available_at
LIMIT 10
