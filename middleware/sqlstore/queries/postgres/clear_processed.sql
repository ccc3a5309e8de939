-- After COMMIT (or a duplicate's rollback): the key is processed, so a live attempt record is
-- stale and deleted. The EXISTS check leaves it alone when the commit did not happen.
DELETE FROM {{.Attempts}}
WHERE {{template "key" .}} AND dead_lettered_at IS NULL
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
