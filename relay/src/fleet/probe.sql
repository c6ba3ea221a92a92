-- One tenant's part of its database's probe (the parts joined by UNION
-- ALL, up to a chunk of tenants per statement): its place in the chunk,
-- {i}, when an event is due in its outbox, unordered or ordered (one look
-- into `outbox_due_idx` and one into `outbox_ordered_due_idx`), and
-- whether ordered ones are (they need the tenant's partition leases: its
-- upkeep is started for them).
SELECT {i}::int4 AS tenant, due.ordered
FROM (SELECT EXISTS (SELECT 1 FROM {schema}.outbox WHERE aggregate_seq IS NULL AND available_at <= now()) AS unordered,
             EXISTS (SELECT 1 FROM {schema}.outbox WHERE aggregate_seq IS NOT NULL AND available_at <= now()) AS ordered) due
WHERE due.unordered OR due.ordered
