-- Delete up to $3 rows of {table} published before $2, from the cursor $1
-- on (NULL: from the start), oldest first; how many, and the last one's
-- time (the next chunk's cursor).
WITH gone AS (
    DELETE FROM {schema}.{table} WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.{table}
        WHERE published_at >= coalesce($1::timestamptz, '-infinity') AND published_at < $2
        ORDER BY published_at LIMIT $3))
    RETURNING published_at)
SELECT count(*), max(published_at) FILTER (WHERE published_at > '-infinity') FROM gone
