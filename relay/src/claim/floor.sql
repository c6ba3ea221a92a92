-- One reading of the floor: the clock, and each transaction of another
-- backend that holds the outbox open for writing (RowExclusiveLock) with
-- its id (a real one, else its virtual one) and its start. No writer: one
-- row of nulls beside the clock.
SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8,
       coalesce('x' || x.transactionid, 'v' || l.virtualtransaction),
       (extract(epoch FROM a.xact_start) * 1000000)::int8
FROM (SELECT 1) one
LEFT JOIN pg_locks l
  ON l.locktype = 'relation' AND l.mode = 'RowExclusiveLock'
 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 AND l.relation = to_regclass('{schema}.outbox')
 AND l.pid IS DISTINCT FROM pg_backend_pid()
LEFT JOIN pg_locks x
  ON x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock'
 AND x.virtualtransaction = l.virtualtransaction
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
