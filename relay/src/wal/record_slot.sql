-- Record $1 as the replication slot the schema's capture reads (the table
-- holds one row).
INSERT INTO {schema}.outbox_wal_capture (slot) VALUES ($1)
ON CONFLICT (singleton) DO UPDATE SET slot = EXCLUDED.slot
