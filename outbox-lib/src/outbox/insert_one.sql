-- One event into the outbox table: $1..$8 its columns (payload and headers
-- as JSON text). An id written before is left as it is.
INSERT INTO {schema}.outbox
    (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8)
ON CONFLICT (id) DO NOTHING
