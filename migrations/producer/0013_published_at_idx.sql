-- Producer schema, version 13: the archive of published events read by
-- time (the console's reconciliation: "published, not processed" in a
-- window). Without it, reading one hour of `outbox_published` scans the
-- whole archive.
--
-- On a large existing archive this CREATE INDEX takes a lock that blocks
-- the relay's archiving while it runs: apply this migration when the
-- archive is small or the relays are stopped, or create the index
-- CONCURRENTLY by hand first (same name; IF NOT EXISTS skips it here; a
-- failed CONCURRENTLY build leaves an INVALID index: drop it and build it
-- again before migrating).
CREATE INDEX IF NOT EXISTS outbox_published_published_at_idx
    ON outbox_published (published_at);
