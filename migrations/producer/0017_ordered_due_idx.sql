-- Producer schema, version 17: ordered events read by when they became due.
--
-- The relay's ordered claim used to find each aggregate's head by walking
-- `outbox_ordered_idx` in key order. A published event's index entry stays
-- until a vacuum may remove it, and none may while something holds the
-- xmin horizon back, so that walk stepped over every ordered event
-- published since the horizon was taken, on every claim. Now each worker
-- walks the ordered events that became due since its cursor in this index
-- (relay/src/claim/ordered.rs), as the unordered claim does in
-- `outbox_due_idx`, and finds each aggregate's head from the last sequence
-- number it knows to be gone.
--
-- On a large existing outbox this CREATE INDEX takes a lock that blocks
-- producers' inserts while it runs: apply this migration when the backlog
-- is small, or create the index CONCURRENTLY by hand first (same name and
-- definition; IF NOT EXISTS skips it here; a failed CONCURRENTLY build
-- leaves an INVALID index: drop it and build it again before migrating).
-- docs/OPERATIONS.md, "Upgrading (migration 17)".
CREATE INDEX IF NOT EXISTS outbox_ordered_due_idx
    ON outbox (available_at, id) WHERE aggregate_seq IS NOT NULL;
