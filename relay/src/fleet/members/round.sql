-- One membership round of fleet $1 (named $2): its heartbeat, good for $3
-- milliseconds, and the ids of the fleets alive now, its own included.
-- Rows a minute past their expiry (fleets that died) are removed.
WITH beat AS (
    INSERT INTO {schema}.outbox_fleet_members (id, name, expires_at)
    VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond')
    ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name, expires_at = EXCLUDED.expires_at
), gone AS (
    DELETE FROM {schema}.outbox_fleet_members
    WHERE expires_at < clock_timestamp() - interval '1 minute' AND id <> $1
)
SELECT id FROM {schema}.outbox_fleet_members WHERE expires_at > clock_timestamp() AND id <> $1
UNION
SELECT $1::uuid
