-- After COMMIT, in the same round trip: deletes the key's attempt record if the claim did
-- commit (COMMIT may have answered ROLLBACK, which ends no pipeline). Also sent after a
-- duplicate's rollback: the key is processed, so a live record is stale.
DELETE FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NULL
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
