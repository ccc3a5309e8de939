-- clear_processed.sql after COMMIT, for REPEATABLE READ and SERIALIZABLE claims (whose snapshot
-- predates the count made after the claim), in a transaction of its own that commits
-- asynchronously (set_config with is_local: this statement's transaction only). It deletes
-- nothing when COMMIT answered ROLLBACK (the claim's row is not there); a clean-up lost to a
-- crash only leaves a stale record of a processed key, which the key's next duplicate deletes.
WITH async AS (SELECT set_config('synchronous_commit', 'off', true))
DELETE FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NULL
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
  AND EXISTS (SELECT 1 FROM async)
