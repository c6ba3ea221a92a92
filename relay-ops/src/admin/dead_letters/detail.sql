-- One dead letter in full. $1 its id.
SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at,
       dead_lettered_at, payload, headers, exchange, routing_key, aggregate_seq, error_history
FROM {schema}.outbox_dead_letters
WHERE id = $1
