-- The live (not dead-lettered) attempt record of a key, locked for the settle statements.
SELECT attempts, COALESCE(last_error, '') FROM {{.Attempts}}
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
FOR UPDATE
