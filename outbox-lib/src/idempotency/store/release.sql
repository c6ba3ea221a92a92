-- Give the lease up: $1 scope, $2 key, $3 owner.
UPDATE {schema}.idempotency_keys SET locked_until = now()
WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND lease_owner = $3
