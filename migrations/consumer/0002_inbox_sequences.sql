-- Consumer schema, version 2: per-aggregate sequence tracking for ordered
-- consumption (`ConsumerConfig::ordering`). Applied by
-- `outbox_consumer::migrate`, inside one transaction, with search_path set
-- to the configured schema. See docs/INBOX_TABLE.md.

-- The last applied `x-aggregate-seq` per consumer name and aggregate. A
-- consumer locks the rows of a batch's aggregates (creating them at 0),
-- applies the events that come next in sequence, and raises last_seq in
-- the same transaction as their effects. State, not dedup records: the
-- inbox retention cleanup never deletes these rows.
CREATE TABLE inbox_sequences (
    consumer       text        NOT NULL CHECK (consumer <> ''),
    aggregate_type text        NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id   text        NOT NULL CHECK (aggregate_id <> ''),
    last_seq       bigint      NOT NULL CHECK (last_seq >= 0),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);
