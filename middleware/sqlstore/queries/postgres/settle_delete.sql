-- Deletes a live attempt record left with no attempt and no error.
DELETE FROM {{.Attempts}} WHERE {{template "key" .}} AND dead_lettered_at IS NULL
