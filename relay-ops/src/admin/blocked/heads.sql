-- A fragment: the WHERE clause on `outbox o` that makes o a blocked aggregate's head
-- (blocked_heads in blocked.rs says why a probe, not NOT EXISTS). No parameters.
WHERE o.aggregate_seq IS NOT NULL AND o.attempts > 0
  AND (SELECT 1 FROM {schema}.outbox e
       WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id
         AND e.aggregate_seq < o.aggregate_seq LIMIT 1) IS NULL
