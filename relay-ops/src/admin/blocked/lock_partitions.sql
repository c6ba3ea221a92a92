-- Locks the lease rows of the partitions of the events $1 (ids), in partition order.
SELECT partition FROM {schema}.outbox_leases
WHERE partition IN (SELECT {schema}.outbox_partition(aggregate_type, aggregate_id)
                    FROM {schema}.outbox WHERE id = ANY($1))
ORDER BY partition
FOR UPDATE
