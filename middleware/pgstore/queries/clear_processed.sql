-- Deletes the key's attempt record once its claim is processed: sent with COMMIT, inside the
-- claim's transaction under READ COMMITTED (so it commits or rolls back with the claim), and
-- after a duplicate's rollback (the key is processed, so a live record is stale).
DELETE FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NULL
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
