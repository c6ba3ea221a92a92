-- Record version $3 of consumer $1's entity $2 if it is newer than the one
-- recorded; a row when it was.
INSERT INTO {schema}.inbox_versions AS v (consumer, entity, version) VALUES ($1, $2, $3)
ON CONFLICT (consumer, entity) DO UPDATE
    SET version = EXCLUDED.version, updated_at = now()
    WHERE v.version < EXCLUDED.version
RETURNING 1
