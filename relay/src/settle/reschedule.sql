-- Record a failed attempt and when to try again. $1 ids, $2 delays in ms,
-- $3 errors. The error history keeps its last 20 entries. The next
-- attempt's time counts from now on the clock (`clock_timestamp()`), not
-- from the batch's start: the claim's cursor (claim/floor.rs) may pass a
-- key earlier than the moment it is written.
UPDATE {schema}.outbox o
SET attempts = o.attempts + 1,
    available_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    last_error = f.error,
    error_history = {error_history(o.error_history, f.error)}
FROM unnest($1::uuid[], $2::bigint[], $3::text[]) AS f(id, delay_ms, error)
WHERE o.id = f.id
