-- Deletes one bounded batch of processed rows received more than @age_micros microseconds
-- ago by the server's clock, oldest first (the received_at index), optionally of one
-- consumer. DATETIME has no time zone: received_at was written as CURRENT_TIMESTAMP(6) in the
-- session's zone, so the cut is taken in the same zone, never from a client's clock. Each
-- batch is its own short transaction, so the purge never holds many row locks beside the
-- claims.
DELETE FROM {{.Table}}
WHERE received_at < CURRENT_TIMESTAMP(6) - INTERVAL @age_micros MICROSECOND
  AND (@consumer_name IS NULL OR consumer_name = @consumer_name)
ORDER BY received_at
LIMIT @batch_size
