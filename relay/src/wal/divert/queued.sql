-- Of the ordered aggregates $1 types, $2 ids, those with events in the
-- outbox table: the log's reader queues their events behind them.
SELECT DISTINCT o.aggregate_type, o.aggregate_id
FROM unnest($1::text[], $2::text[]) AS a(aggregate_type, aggregate_id)
JOIN {schema}.outbox o ON o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
WHERE o.aggregate_seq IS NOT NULL
