-- The live (not dead-lettered) attempt record of a key, locked for settle_update.sql or
-- settle_delete.sql in the same transaction.
SELECT attempts, coalesce(last_error, '') FROM {{.Attempts}}
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
FOR UPDATE
