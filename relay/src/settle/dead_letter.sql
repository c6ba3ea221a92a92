-- Move events to the dead-letter table with their history (its last 20
-- entries). $1 ids, $2 final errors.
WITH f AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS f(id, error)),
     d AS (DELETE FROM {schema}.outbox o USING f WHERE o.id = f.id
           RETURNING o.*, f.error AS final_error)
INSERT INTO {schema}.outbox_dead_letters ({event_columns}, attempts, last_error, error_history)
SELECT {event_columns}, attempts + 1, final_error,
       {error_history(d.error_history, d.final_error)}
FROM d
ON CONFLICT (id) DO UPDATE SET
    payload = EXCLUDED.payload, headers = EXCLUDED.headers, exchange = EXCLUDED.exchange,
    routing_key = EXCLUDED.routing_key, attempts = EXCLUDED.attempts,
    last_error = EXCLUDED.last_error, error_history = EXCLUDED.error_history,
    aggregate_seq = EXCLUDED.aggregate_seq, dead_lettered_at = now()
