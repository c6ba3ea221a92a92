-- The schema and its ledger of applied migrations, where missing (in a
-- transaction, so SET LOCAL silences the "already exists" notices).
SET LOCAL client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.outbox_toolkit_migrations (
    migration_set text NOT NULL,
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (migration_set, version));
