-- A fragment: the rows of {schema}.{table} now, estimated (see estimated_rows in estimate.rs),
-- as a scalar subquery. No parameters.
(SELECT CASE WHEN c.reltuples >= 0 AND c.relpages > 0
             THEN c.reltuples / c.relpages
                  * (pg_relation_size(c.oid) / current_setting('block_size')::float8)
             WHEN pg_relation_size(c.oid) = 0 THEN 0
             ELSE (SELECT count(*) * 100.0 / p.pct
                   FROM {schema}.{table} TABLESAMPLE SYSTEM (p.pct)) END
 FROM pg_class c,
      LATERAL (SELECT {sample_percent} AS pct) p
 WHERE c.oid = to_regclass('{schema}.{table}'))
