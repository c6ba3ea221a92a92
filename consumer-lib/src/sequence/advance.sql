-- Raise last_seq of consumer $1's aggregates ($2 types, $3 ids) to $4,
-- rows this transaction holds locked.
UPDATE {schema}.inbox_sequences AS q SET last_seq = u.seq, updated_at = now()
FROM unnest($2::text[], $3::text[], $4::bigint[]) AS u(t, i, seq)
WHERE q.consumer = $1 AND q.aggregate_type = u.t AND q.aggregate_id = u.i
