-- The key's attempt record, read after the claim in a statement of its own, so that under
-- READ COMMITTED it sees what a delivery that held the key before recorded.
SELECT attempts, last_error, dead_lettered_at IS NOT NULL
FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name
