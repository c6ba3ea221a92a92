-- HTTP Idempotency-Key records: one row per (scope, key). A public contract,
-- documented column by column in docs/IDEMPOTENCY.md. Runs with search_path
-- set to the target schema.

CREATE TABLE idempotency_keys (
    -- Chosen by the service: tenant or principal plus endpoint. Keys of
    -- different scopes never collide.
    scope            text        NOT NULL CHECK (scope <> ''),
    -- The client's key: 1 to 255 visible ASCII characters.
    key              text        NOT NULL CHECK (key ~ '^[!-~]{1,255}$'),
    -- SHA-256 of the request (method, path, body, or a subset the service
    -- picks). The same key with another fingerprint is rejected (422).
    fingerprint      bytea       NOT NULL CHECK (length(fingerprint) = 32),
    -- 'in_progress': claimed, not finished. An atomic claim is never
    -- committed in this state; a two-phase claim is, with a lease.
    -- 'completed': the response below is recorded and replayed.
    state            text        NOT NULL DEFAULT 'in_progress'
                                 CHECK (state IN ('in_progress', 'completed')),
    response_status  integer     CHECK (response_status BETWEEN 100 AND 599),
    -- The replayed headers, as a JSON array of [name, value] pairs (a name
    -- may repeat).
    response_headers jsonb       NOT NULL DEFAULT '[]'
                                 CHECK (jsonb_typeof(response_headers) = 'array'),
    response_body    bytea,
    -- Two-phase mode: the last step reached, where a retry resumes.
    recovery_point   text,
    -- Two-phase mode: the lease. While locked_until is in the future, the
    -- holder (lease_owner) owns the key and a retry gets 409.
    locked_until     timestamptz,
    lease_owner      uuid,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    -- After this instant the record counts as absent: the key may be
    -- reused and executes anew. Default: created_at + 24 hours.
    expires_at       timestamptz NOT NULL DEFAULT now() + interval '24 hours',
    PRIMARY KEY (scope, key),
    CHECK (state <> 'completed'
           OR (response_status IS NOT NULL AND response_body IS NOT NULL AND completed_at IS NOT NULL))
);

-- For cleanup_idempotency_keys: DELETE ... WHERE expires_at <= now().
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
