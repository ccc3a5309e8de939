-- Sets a live attempt record's count and last error (a failure counted before its handler, or
-- a count taken back that leaves something to keep).
UPDATE {{.Attempts}} SET attempts = @attempts, last_error = @last_error
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
