-- Producer schema, version 8: which broker node each relay publishes to
-- (`host:port`, no user info), for `outbox-relay status` on a cluster.
-- Written by the relay after a lease round when it changed; NULL until then
-- and for relays of earlier versions.
ALTER TABLE outbox_relays ADD COLUMN broker text;
