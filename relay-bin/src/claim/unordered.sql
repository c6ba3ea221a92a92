-- Due unordered events, oldest first, skipping rows other relays hold.
-- $1 batch size.
SELECT {claimed_columns} FROM {schema}.outbox
WHERE available_at <= now() AND aggregate_seq IS NULL
ORDER BY available_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED
