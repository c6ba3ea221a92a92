-- The outbox's dead rows (its statistics' estimate) and its bytes on disk with its indexes;
-- 0 and 0 without such a table. No parameters.
SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
                 WHERE relid = to_regclass('{schema}.outbox')), 0),
       coalesce(pg_total_relation_size(to_regclass('{schema}.outbox')), 0)
