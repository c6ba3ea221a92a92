-- Remove delivered events. $1 ids.
DELETE FROM {schema}.outbox WHERE id = ANY($1)
