-- The last $1 minutes of outbox_publish_stats, oldest first, one row per minute (zeros
-- where no relay recorded anything).
SELECT m.minute, coalesce(p.published, 0) AS published,
       coalesce(p.dead_lettered, 0) AS dead_lettered
FROM generate_series(date_trunc('minute', now()) - ($1 - 1) * interval '1 minute',
                     date_trunc('minute', now()), interval '1 minute') AS m(minute)
LEFT JOIN {schema}.outbox_publish_stats p ON p.minute = m.minute
ORDER BY m.minute
