-- Events of the log the reader did not deliver, into the outbox table as
-- never attempted (the settle that follows records the attempt). $1..$10:
-- the event columns in their order, as arrays.
INSERT INTO {schema}.outbox ({event_columns})
SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange,
       routing_key, created_at, aggregate_seq
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::text[], $9::timestamptz[], $10::bigint[])
     AS e({event_columns})
ON CONFLICT DO NOTHING
