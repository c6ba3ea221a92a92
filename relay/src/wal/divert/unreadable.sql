-- Messages of the log that are no event, into the dead letters. $1 ids,
-- $2 positions, $3 contents, $4 errors.
INSERT INTO {schema}.outbox_dead_letters
    (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, attempts,
     last_error, error_history)
SELECT id, '(unreadable)', 'lsn ' || lsn, '(unreadable)', to_jsonb(content), '{}'::jsonb, now(), 0,
       error, {error_history('[]'::jsonb, error)}
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]) AS u(id, lsn, content, error)
ON CONFLICT (id) DO NOTHING
