-- After COMMIT (or a duplicate's rollback): deletes the processed key's stale attempt record.
DELETE FROM {{.Attempts}}
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
