-- Events into the outbox table, $1..$8 their columns as arrays, in
-- aggregate key order (input order within an aggregate): ordered
-- aggregates' counters are taken in one order by every writer.
INSERT INTO {schema}.outbox
    (id, aggregate_type, aggregate_id, event_type, payload, headers, exchange, routing_key)
SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb, exchange,
       routing_key
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::text[])
     WITH ORDINALITY AS e(id, aggregate_type, aggregate_id, event_type, payload, headers,
                          exchange, routing_key, n)
ORDER BY aggregate_type, aggregate_id, n
ON CONFLICT (id) DO NOTHING
