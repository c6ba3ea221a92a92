-- Consumer schema, version 1: the inbox that makes effects exactly-once.
-- Applied by `outbox_consumer::migrate`, inside one transaction, with
-- search_path set to the configured schema. See docs/INBOX_TABLE.md.

CREATE TABLE inbox (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    event_id     text        NOT NULL CHECK (event_id <> ''),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention cleanup deletes by age.
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at);

-- Current versions for state-carrying events (the version-check helper).
CREATE TABLE inbox_versions (
    consumer   text        NOT NULL,
    entity     text        NOT NULL,
    version    bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, entity)
);
