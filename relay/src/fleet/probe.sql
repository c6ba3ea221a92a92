-- One tenant's part of its database's probe (the parts joined by UNION
-- ALL, up to a chunk of tenants per statement): its place in the chunk,
-- {i}, when an event is due in its outbox, unordered or ordered (one look
-- into `outbox_due_idx` or `outbox_ordered_due_idx` each).
SELECT {i}::int4 AS tenant
WHERE EXISTS (SELECT 1 FROM {schema}.outbox WHERE aggregate_seq IS NULL AND available_at <= now())
   OR EXISTS (SELECT 1 FROM {schema}.outbox WHERE aggregate_seq IS NOT NULL AND available_at <= now())
