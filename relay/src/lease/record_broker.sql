-- Record relay $1's broker node $2 in the relay list.
UPDATE {schema}.outbox_relays SET broker = $2 WHERE id = $1
