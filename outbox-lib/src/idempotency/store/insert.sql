-- A new record: $1 scope, $2 key, $3 fingerprint, $4 ttl secs, $5
-- recovery point, $6 lease secs, $7 lease owner (the last three NULL in
-- atomic mode). A row when it was inserted.
INSERT INTO {schema}.idempotency_keys
    (scope, key, fingerprint, expires_at, recovery_point, locked_until, lease_owner)
VALUES ($1, $2, $3, now() + make_interval(secs => $4), $5,
        now() + make_interval(secs => $6), $7)
ON CONFLICT (scope, key) DO NOTHING
RETURNING true
