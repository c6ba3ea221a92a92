-- Fleet $1 stops: it leaves at once (the others take its share at their
-- next round, not a TTL later).
DELETE FROM {schema}.outbox_fleet_members WHERE id = $1
