-- One event into the log: $1 the schema's message prefix, $2 the
-- message's head, $3 and $4 its aggregate type and id. One plain
-- statement, no function call unless the type is ordered (measured
-- cheaper for producers than calling `outbox_emit`). Nothing is written
-- when no slot would read it (`outbox_wal_readable`, a one-time filter).
SELECT pg_logical_emit_message(true, $1, $2 || {wal_tail})
FROM (SELECT $3::text AS aggregate_type, $4::text AS aggregate_id) e
WHERE EXISTS (SELECT 1 FROM {schema}.outbox_wal_readable)
