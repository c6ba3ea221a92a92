-- The outbox's rows, estimated (float8), and the percentage of its pages a sample of the
-- estimates' size reads (float4). No parameters.
SELECT coalesce({estimated_rows}, 0), {sample_percent}
FROM (SELECT pg_relation_size(to_regclass('{schema}.outbox')) AS size) r
