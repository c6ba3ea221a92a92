-- The relay's gauges: the backlog, the seconds the most overdue unordered event has been
-- due (0: none), the dead letters, the blocked aggregates. No parameters.
SELECT {backlog},
       coalesce(greatest(0, extract(epoch FROM now() - (
           SELECT available_at FROM {schema}.outbox WHERE aggregate_seq IS NULL
           ORDER BY available_at, id LIMIT 1)))::float8, 0),
       {dead_letters},
       (SELECT count(*) FROM {schema}.outbox o {blocked_heads})
