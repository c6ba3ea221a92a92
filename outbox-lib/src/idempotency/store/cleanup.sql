-- Delete up to $2 expired records from the cursor $1 on (NULL: from the
-- start), oldest first; how many, and the last one's expiry (the next
-- chunk's cursor).
WITH gone AS (
    DELETE FROM {schema}.idempotency_keys WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.idempotency_keys
        WHERE expires_at >= coalesce($1::timestamptz, '-infinity') AND expires_at <= now()
        ORDER BY expires_at LIMIT $2))
    RETURNING expires_at)
SELECT count(*), max(expires_at) FILTER (WHERE expires_at > '-infinity') FROM gone
