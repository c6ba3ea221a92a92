-- Record a recovery point and renew the lease: $1 scope, $2 key, $3
-- recovery point, $4 lease secs, $5 owner.
UPDATE {schema}.idempotency_keys
SET recovery_point = $3, locked_until = now() + make_interval(secs => $4)
WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND lease_owner = $5
