-- Add $1 published and $2 dead-lettered events to this minute of
-- outbox_publish_stats (the console's rate chart); rows older than 7 days go.
WITH up AS (
    INSERT INTO {schema}.outbox_publish_stats AS t (minute, published, dead_lettered)
    VALUES (date_trunc('minute', now()), $1, $2)
    ON CONFLICT (minute) DO UPDATE
    SET published = t.published + EXCLUDED.published,
        dead_lettered = t.dead_lettered + EXCLUDED.dead_lettered)
DELETE FROM {schema}.outbox_publish_stats WHERE minute < now() - interval '7 days'
