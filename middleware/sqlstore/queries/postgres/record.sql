-- The key's attempt record, read after the claim in a statement of its own, so that under
-- READ COMMITTED it sees what the delivery that held the key before recorded.
SELECT attempts, coalesce(last_error, ''), dead_lettered_at IS NOT NULL
FROM {{.Attempts}} WHERE {{template "key" .}}
