-- The first $3 events waiting behind the head of each aggregate ($1 types, $2 ids, in
-- pairs), in the aggregates' order, then in sequence order: one index descent each.
SELECT a.t AS aggregate_type, a.i AS aggregate_id, w.id, w.event_type, w.aggregate_seq,
       w.created_at
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS a(t, i, n)
CROSS JOIN LATERAL (
    SELECT o.id, o.event_type, o.aggregate_seq, o.created_at FROM {schema}.outbox o
    WHERE o.aggregate_type = a.t AND o.aggregate_id = a.i AND o.aggregate_seq IS NOT NULL
    ORDER BY o.aggregate_seq OFFSET 1 LIMIT $3) w
ORDER BY a.n, w.aggregate_seq
