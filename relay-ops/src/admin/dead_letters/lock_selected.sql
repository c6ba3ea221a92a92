-- The start of the replay's lock of the selected dead letters: each id, whether the outbox
-- holds it, and whether the outbox's CHECKs would take it. The selection's conditions follow
-- (` AND ...`, with their binds), then the order and `FOR UPDATE OF d`.
SELECT d.id,
       EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.id = d.id),
       {schema}.outbox_unpublishable(d.aggregate_type, d.event_type, d.exchange,
                                     d.routing_key, d.headers) IS NULL
FROM {schema}.outbox_dead_letters d
WHERE TRUE
