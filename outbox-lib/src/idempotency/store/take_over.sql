-- Take over the lapsed lease of an in-progress record: $1 scope, $2 key,
-- $3 lease secs, $4 new owner. Returns the recovery point.
UPDATE {schema}.idempotency_keys
SET locked_until = now() + make_interval(secs => $3), lease_owner = $4
WHERE scope = $1 AND key = $2 AND state = 'in_progress'
  AND (locked_until IS NULL OR locked_until <= now())
RETURNING recovery_point
