-- A fragment: the rows of {schema}.{table} (bigint), counted when the estimate says at most
-- {exact_count_up_to}, else the estimate. No parameters.
(SELECT CASE WHEN e.n <= {exact_count_up_to} THEN (SELECT count(*) FROM {schema}.{table})
             ELSE e.n::bigint END
 FROM (SELECT {estimated_rows} AS n) e)
