-- Takes back the count of a claim whose round trip lost its answer (claim.go), once the server
-- process that ran it has ended: only if the key's record still carries the count's token, so
-- a count made since by a copy of the message is left alone. A record left with no attempt and
-- no error is deleted. Returns the count afterwards; no row when there was nothing to take back.
WITH d AS (
  DELETE FROM {{.Attempts}}
  WHERE message_id = @message_id AND consumer_name = @consumer_name AND count_token = @count_token
    AND dead_lettered_at IS NULL AND attempts <= 1 AND last_error IS NULL
  RETURNING 0 AS attempts
), u AS (
  UPDATE {{.Attempts}}
  SET attempts = greatest(attempts - 1, 0), count_token = NULL
  WHERE message_id = @message_id AND consumer_name = @consumer_name AND count_token = @count_token
    AND dead_lettered_at IS NULL AND NOT (attempts <= 1 AND last_error IS NULL)
  RETURNING attempts
)
SELECT attempts FROM d UNION ALL SELECT attempts FROM u
