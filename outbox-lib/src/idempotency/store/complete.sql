-- Record the response: $1 scope, $2 key, $3 status, $4 headers, $5 body,
-- $6 owner (NULL: atomic mode).
UPDATE {schema}.idempotency_keys
SET state = 'completed', response_status = $3, response_headers = $4,
    response_body = $5, completed_at = now(), locked_until = NULL, lease_owner = NULL
WHERE scope = $1 AND key = $2 AND state = 'in_progress'
  AND lease_owner IS NOT DISTINCT FROM $6
