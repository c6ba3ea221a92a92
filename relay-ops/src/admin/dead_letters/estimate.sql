-- The start of an estimate of the dead letters a selection holds: the matches in a sample of
-- about estimate::SAMPLE_PAGES of the table's pages, scaled up. The selection's conditions
-- follow (` AND ...`, with their binds), then `) * 100.0 / p.pct)::int8 FROM p`.
WITH p AS (
    SELECT {sample_percent} AS pct
    FROM (SELECT pg_relation_size(to_regclass('{schema}.outbox_dead_letters')) AS size) r
)
SELECT ((SELECT count(*) FROM {schema}.outbox_dead_letters d TABLESAMPLE SYSTEM (p.pct)
         WHERE TRUE
