-- An expired record replaced by a new one; the binds of insert.sql.
UPDATE {schema}.idempotency_keys
SET fingerprint = $3, state = 'in_progress', response_status = NULL,
    response_headers = '[]', response_body = NULL, completed_at = NULL,
    created_at = now(), expires_at = now() + make_interval(secs => $4),
    recovery_point = $5, locked_until = now() + make_interval(secs => $6),
    lease_owner = $7
WHERE scope = $1 AND key = $2 AND expires_at <= now()
RETURNING true
