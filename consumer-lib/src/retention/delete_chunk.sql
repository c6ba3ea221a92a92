-- Delete up to $4 records of {table} processed before $2 (of consumer $3,
-- or of every consumer when NULL), from the cursor $1 on (NULL: from the
-- start), oldest first; how many, and the last one's time (the next
-- chunk's cursor).
WITH gone AS (
    DELETE FROM {schema}.{table} WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.{table}
        WHERE processed_at >= coalesce($1::timestamptz, '-infinity') AND processed_at < $2
          AND ($3::text IS NULL OR consumer = $3)
        ORDER BY processed_at LIMIT $4))
    RETURNING processed_at)
SELECT count(*), max(processed_at) FILTER (WHERE processed_at > '-infinity') FROM gone
