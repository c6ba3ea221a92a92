-- The missing events (reconcile/missing.sql: $1 consumer, $2 and $3 the window, $4 the
-- routing key's pattern) as the relay published them, oldest first: the first $5.
SELECT p.id, p.aggregate_type, p.aggregate_id, p.event_type, p.payload::text,
       p.headers::text, p.exchange, p.routing_key, p.created_at, p.attempts, p.aggregate_seq
{missing}
ORDER BY p.published_at, p.id
LIMIT $5
