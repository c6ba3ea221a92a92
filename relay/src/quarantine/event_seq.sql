-- The aggregate_seq of event $1 (no row: it left the outbox).
SELECT aggregate_seq FROM {schema}.outbox WHERE id = $1
