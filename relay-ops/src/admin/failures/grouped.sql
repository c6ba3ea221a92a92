-- The dead letters grouped three ways (GROUPING SETS: kind {by_error_class} by error class,
-- {by_event_type} by event type, else by exchange): the $1 largest groups of each kind, then
-- per kind the rest together (others: how many groups, their dead letters, the newest).
WITH grouped AS (
    SELECT GROUPING(d.error_class, d.event_type, d.exchange) AS kind,
           CASE GROUPING(d.error_class, d.event_type, d.exchange)
               WHEN {by_error_class} THEN d.error_class
               WHEN {by_event_type} THEN d.event_type
               ELSE d.exchange END AS key,
           count(*) AS dead_letters, max(d.dead_lettered_at) AS newest
    FROM {schema}.outbox_dead_letters d
    GROUP BY GROUPING SETS ((d.error_class), (d.event_type), (d.exchange))
), ranked AS (
    SELECT g.*,
           row_number() OVER (PARTITION BY g.kind
                              ORDER BY g.dead_letters DESC, g.key NULLS FIRST) AS rank
    FROM grouped g
)
SELECT kind, false AS others, key, dead_letters, newest, 1::bigint AS groups, rank
FROM ranked WHERE rank <= $1
UNION ALL
SELECT kind, true, NULL, sum(dead_letters)::bigint, max(newest), count(*), NULL
FROM ranked WHERE rank > $1 GROUP BY kind
ORDER BY kind, others, rank
