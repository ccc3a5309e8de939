-- Deletes the key's dead-lettered record, so its next delivery runs the handler again.
DELETE FROM {{.Attempts}} WHERE {{template "key" .}} AND dead_lettered_at IS NOT NULL
