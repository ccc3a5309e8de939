-- Applies @delta (0 or -1: a failure already counted, or a count taken back) and the last
-- error to a key's record in one statement, so it is applied wholly or not at all: a record
-- left with no attempt and no error is deleted, any other updated (the two conditions exclude
-- each other). A dead-lettered record is left alone. Returns the count.
WITH d AS (
  DELETE FROM {{.Attempts}}
  WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NULL
    AND attempts + @delta <= 0 AND coalesce(@last_error, last_error) IS NULL
  RETURNING 0 AS attempts
), u AS (
  UPDATE {{.Attempts}}
  SET attempts = greatest(attempts + @delta, 0), last_error = coalesce(@last_error, last_error)
  WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NULL
    AND NOT (attempts + @delta <= 0 AND coalesce(@last_error, last_error) IS NULL)
  RETURNING attempts
)
SELECT attempts FROM d UNION ALL SELECT attempts FROM u
