-- One page of the schemas whose ledger (`outbox_toolkit_migrations`) this
-- database holds, in name order after $3 (from the first when null), at
-- most $4, their names LIKE $2 (all when null): each with whether this
-- role may read the ledger and, where it may, the newest version of set
-- $1 recorded in it (null when the set has none). Each ledger is read
-- inside this one statement by `query_to_xml`. A ledger this role may not
-- read is not queried (its error would fail the whole statement) but
-- listed as unreadable. Each ledger read holds a lock until the statement
-- ends: pages keep them well inside the server's lock table
-- (max_locks_per_transaction × max_connections).
SELECT n.nspname::text AS schema,
       readable,
       CASE WHEN readable THEN
           (xpath('/row/v/text()', query_to_xml(
               format('SELECT max(version) AS v FROM %I.outbox_toolkit_migrations WHERE migration_set = %L',
                      n.nspname, $1::text),
               false, true, '')))[1]::text::int
       END AS found
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN LATERAL (
    -- Null for a table dropped since this statement's catalog snapshot.
    SELECT coalesce(has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT'), false)
        AS readable) r
WHERE c.relname = 'outbox_toolkit_migrations' AND c.relkind IN ('r', 'p')
  AND ($2::text IS NULL OR n.nspname LIKE $2::text)
  AND ($3::text IS NULL OR n.nspname > $3::text)
ORDER BY n.nspname
LIMIT $4
