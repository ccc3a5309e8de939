-- Deletes one bounded batch of processed rows received before @before, oldest first
-- (the received_at index), optionally of one consumer.
DELETE FROM {{.Table}} WHERE ctid IN (
    SELECT ctid FROM {{.Table}}
    WHERE received_at < @before AND (@consumer_name::text IS NULL OR consumer_name = @consumer_name::text)
    ORDER BY received_at LIMIT @batch_size)
