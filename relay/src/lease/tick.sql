-- One lease round (outbox_lease_tick, migration 3): heartbeat, renew,
-- rebalance. $1 relay id, $2 name, $3 TTL in ms. Returns the partitions held.
SELECT p FROM {schema}.outbox_lease_tick($1, $2, $3 * interval '1 millisecond') AS p
