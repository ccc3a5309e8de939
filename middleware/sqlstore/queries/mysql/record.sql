-- The key's attempt record, read after the claim.
SELECT attempts, COALESCE(last_error, ''), dead_lettered_at IS NOT NULL
FROM {{.Attempts}} WHERE {{template "key" .}}
