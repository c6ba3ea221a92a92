-- Events into the log: $1 the schema's message prefix, $2 the messages'
-- heads, $3 and $4 their aggregate types and ids, in aggregate key order
-- (input order within an aggregate), like the insert. A sorted subquery
-- is never flattened, so the messages are emitted in that order.
SELECT pg_logical_emit_message(true, $1, e.head || {wal_tail})
FROM (SELECT * FROM unnest($2::text[], $3::text[], $4::text[])
           WITH ORDINALITY AS e(head, aggregate_type, aggregate_id, n)
      ORDER BY aggregate_type, aggregate_id, n) e
WHERE EXISTS (SELECT 1 FROM {schema}.outbox_wal_readable)
