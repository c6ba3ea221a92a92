-- Lock the rows of consumer $1's aggregates ($2 types, $3 ids, sorted by
-- the caller), creating missing ones at 0, and return their last applied
-- sequence numbers; `created` marks a row this statement made.
INSERT INTO {schema}.inbox_sequences AS q (consumer, aggregate_type, aggregate_id, last_seq)
SELECT $1, k.t, k.i, 0
FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(t, i, n) ORDER BY k.n
ON CONFLICT (consumer, aggregate_type, aggregate_id)
DO UPDATE SET last_seq = q.last_seq
RETURNING q.aggregate_type, q.aggregate_id, q.last_seq, (q.xmax = 0) AS created
