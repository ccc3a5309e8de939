-- Deletes one bounded batch of processed rows received before @before, oldest first (the
-- received_at index), optionally of one consumer. Each batch is its own short transaction,
-- so the purge never holds many row locks beside the claims.
DELETE FROM {{.Table}}
WHERE received_at < @before AND (@consumer_name IS NULL OR consumer_name = @consumer_name)
ORDER BY received_at
LIMIT @batch_size
