-- Give up every lease of relay $1 and leave the relay list.
WITH r AS (DELETE FROM {schema}.outbox_relays WHERE id = $1)
UPDATE {schema}.outbox_leases SET owner = NULL, owner_name = NULL, expires_at = '-infinity'
WHERE owner = $1
