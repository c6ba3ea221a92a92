-- The end of an event's log message, after its head (`wal_head`): the
-- transaction's time, the sequence of an ordered aggregate (of the row
-- `e`'s aggregate_type and aggregate_id) and the closing brace, as
-- `outbox_emit` writes them.
to_json(now())::text
|| CASE WHEN EXISTS (SELECT 1 FROM {schema}.outbox_ordered_types t
                     WHERE t.aggregate_type IN (e.aggregate_type, '*'))
        THEN ',"aggregate_seq":' || {schema}.outbox_next_seq(e.aggregate_type, e.aggregate_id)
        ELSE '' END
|| '}'
