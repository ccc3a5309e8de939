-- Sets a live attempt record's count and last error.
UPDATE {{.Attempts}} SET attempts = @attempts, last_error = @last_error
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
