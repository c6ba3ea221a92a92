-- The relays, by name, each with the partitions it leases now, the seconds since its last
-- heartbeat and its broker node. No parameters.
SELECT r.name, count(l.partition) AS partitions,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age_s,
       r.broker
FROM {schema}.outbox_relays r
LEFT JOIN {schema}.outbox_leases l ON l.owner = r.id AND l.expires_at > now()
GROUP BY r.id, r.name, r.heartbeat_at, r.broker
ORDER BY r.name
