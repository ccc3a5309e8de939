-- Deletes the key's dead-lettered record, so its next delivery runs the handler again.
DELETE FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name AND dead_lettered_at IS NOT NULL
