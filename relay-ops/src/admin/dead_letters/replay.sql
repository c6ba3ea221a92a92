-- Copies the dead letters $1 (ids) into the outbox, due now with attempts reset, the replay
-- appended to their error history; an id in the outbox already is left out. Returns each
-- inserted id and whether the event is older than $2 milliseconds (the retention).
INSERT INTO {schema}.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers,
                             exchange, routing_key, created_at, available_at, attempts,
                             last_error, error_history, aggregate_seq)
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key,
       created_at, clock_timestamp(), 0, NULL,
       {error_history(error_history, 'replayed from dead letters')},
       aggregate_seq
FROM {schema}.outbox_dead_letters
WHERE id = ANY($1)
ON CONFLICT (id) DO NOTHING
RETURNING id, created_at < now() - $2 * interval '1 millisecond'
