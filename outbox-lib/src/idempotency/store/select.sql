-- The record of scope $1, key $2: its state, response, recovery point,
-- whether it has expired and the seconds left on its lease.
SELECT fingerprint, state, response_status, response_headers, response_body,
       recovery_point, expires_at <= now() AS expired,
       extract(epoch FROM locked_until - now())::float8 AS lease_left
FROM {schema}.idempotency_keys WHERE scope = $1 AND key = $2
