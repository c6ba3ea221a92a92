-- One event of the log that the outbox table refuses, straight into the
-- dead letters. $1..$10 the event columns in their order (payload and
-- headers as JSON text), $11 attempts, $12 error.
INSERT INTO {schema}.outbox_dead_letters ({event_columns}, attempts, last_error, error_history)
VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8, $9, $10, $11, $12,
        {error_history('[]'::jsonb, $12::text)})
ON CONFLICT (id) DO NOTHING
