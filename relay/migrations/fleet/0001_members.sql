-- The fleets serving this database's tenants (`outbox-relay run
-- --all-schemas`): each one's heartbeat. The live fleets split the tenants
-- between them by rendezvous hashing of (tenant, fleet id); a fleet whose
-- heartbeat lapses loses its share to the others.
CREATE TABLE outbox_fleet_members (
    id         uuid PRIMARY KEY,
    name       text NOT NULL,
    joined_at  timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
