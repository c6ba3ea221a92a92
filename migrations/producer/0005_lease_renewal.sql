-- Producer schema, version 5: a lease round's renewal and heartbeat no
-- longer depend on its rebalance.
--
-- Giving up a partition changes its owner, a key update that waits for the
-- FOR KEY SHARE locks the relay's own batches in flight hold on that lease
-- row. In version 3 that wait (up to lock_timeout) failed the whole round,
-- renewal and heartbeat included, and after two such rounds the relay's
-- leases lapsed. Now partitions with a batch in flight are skipped (given
-- up at a later round) and nothing in the round waits on a lease row.

CREATE OR REPLACE FUNCTION outbox_lease_tick(p_relay uuid, p_name text, p_ttl interval)
RETURNS SETOF integer LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT SET lock_timeout = '5s' AS $fn$
DECLARE
    live  integer;
    share integer;
    mine  integer;
BEGIN
    INSERT INTO outbox_relays AS r (id, name) VALUES (p_relay, p_name)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now();
    DELETE FROM outbox_relays WHERE heartbeat_at < now() - p_ttl * 10;
    SELECT count(*) INTO live FROM outbox_relays WHERE heartbeat_at > now() - p_ttl;
    share := ceil(64.0 / greatest(live, 1));
    -- Not a key update: does not wait for batches in flight.
    UPDATE outbox_leases SET expires_at = now() + p_ttl WHERE owner = p_relay;
    SELECT count(*) INTO mine FROM outbox_leases WHERE owner = p_relay;
    IF mine > share THEN
        UPDATE outbox_leases SET owner = NULL, owner_name = NULL, expires_at = '-infinity'
        WHERE partition IN (SELECT partition FROM outbox_leases WHERE owner = p_relay
                            ORDER BY partition DESC LIMIT mine - share
                            FOR UPDATE SKIP LOCKED);
    ELSIF mine < share THEN
        UPDATE outbox_leases SET owner = p_relay, owner_name = p_name, expires_at = now() + p_ttl
        WHERE partition IN (SELECT partition FROM outbox_leases
                            WHERE owner IS NULL OR expires_at <= now()
                            ORDER BY partition LIMIT share - mine
                            FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN QUERY SELECT l.partition FROM outbox_leases l WHERE l.owner = p_relay ORDER BY 1;
END
$fn$;
