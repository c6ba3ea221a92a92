-- Producer schema, version 7: the failed ordered events, indexed, so the
-- relay's blocked-aggregates gauge probes them instead of scanning the
-- outbox (few rows: only ordered events that failed at least once).
CREATE INDEX outbox_failed_ordered_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_seq IS NOT NULL AND attempts > 0;
