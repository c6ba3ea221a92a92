-- Producer schema, version 1: the outbox and its dead letters.
-- Applied by `outbox-relay migrate` or `outbox::migrate`, inside one
-- transaction, with search_path set to the configured schema.
-- This table is a public contract: see docs/OUTBOX_TABLE.md.

-- UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then random bits.
-- PostgreSQL 15 has no built-in; producers in other languages get it as the
-- column default, so ids stay time-ordered whoever inserts.
CREATE FUNCTION outbox_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $fn$
    SELECT encode(
        set_bit(
            set_bit(
                overlay(uuid_send(gen_random_uuid())
                        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                        FROM 1 FOR 6),
                52, 1),
            53, 1),
        'hex')::uuid
$fn$;

CREATE TABLE outbox (
    id              uuid        PRIMARY KEY DEFAULT outbox_uuid_v7(),
    aggregate_type  text        NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id    text        NOT NULL CHECK (aggregate_id <> ''),
    event_type      text        NOT NULL CHECK (event_type <> ''),
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(headers) = 'object'),
    exchange        text,
    routing_key     text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      text,
    error_history   jsonb       NOT NULL DEFAULT '[]'::jsonb
);

-- The relay claims "due" rows oldest first; this index makes a claim cost a
-- batch, not a scan of the backlog.
CREATE INDEX outbox_due_idx ON outbox (available_at, id);

CREATE TABLE outbox_dead_letters (
    id               uuid        PRIMARY KEY,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    event_type       text        NOT NULL,
    payload          jsonb       NOT NULL,
    headers          jsonb       NOT NULL,
    exchange         text,
    routing_key      text,
    created_at       timestamptz NOT NULL,
    attempts         integer     NOT NULL,
    last_error       text        NOT NULL,
    error_history    jsonb       NOT NULL DEFAULT '[]'::jsonb,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX outbox_dead_letters_at_idx ON outbox_dead_letters (dead_lettered_at);

-- Delivered events, kept only when the relay runs with --archive.
CREATE TABLE outbox_published (
    id             uuid        PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    exchange       text,
    routing_key    text,
    created_at     timestamptz NOT NULL,
    attempts       integer     NOT NULL,
    published_at   timestamptz NOT NULL DEFAULT now()
);

-- Wake-up hint for relays. Not attached to any table by default: a NOTIFY
-- inside a producer's transaction takes a database-wide lock until commit
-- and serialises producers. See docs/WAKEUP.md for when to attach it.
CREATE FUNCTION outbox_wakeup() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('outbox_' || TG_TABLE_SCHEMA, '');
    RETURN NULL;
END
$fn$;
