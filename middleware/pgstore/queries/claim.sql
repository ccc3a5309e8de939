-- The insert-first claim of one key, the first statement of the inbox transaction.
-- The key's transaction-level advisory lock is tried, never waited for: a delivery in flight
-- holds it from its claim to its COMMIT or ROLLBACK, so when it is taken this inserts nothing
-- and waits for nothing (no pool connection is held while a copy waits: the store retries in
-- process). Zero rows inserted and no stored row (stored_hash.sql): held; zero rows and a
-- stored row: a duplicate. ON CONFLICT DO NOTHING never raises 23505, so a duplicate does not
-- abort the transaction. With attempt counting the lock is taken for the session instead
-- (.Session), released by unlock.sql once the delivery has settled: a failed statement of the
-- handler aborts the transaction and releases its transaction-level locks at once, and the key
-- must stay locked until the failure is recorded, or a copy would run beside the failed
-- delivery and read its attempts one short. A delivery counted before its handler holds the
-- session lock already (count_first.sql), so the transaction-level try always succeeds for it.
INSERT INTO {{.Table}} (
{{- if .Compact}} message_id, consumer_id, payload_hash
{{- else}} message_id, consumer_name, message_type, correlation_id, payload_hash
{{- end}}{{if .Partitioned}}, period{{end}})
SELECT
{{- if .Compact}} @message_id::text::uuid, (SELECT consumer_id FROM {{.Consumers}} WHERE consumer_name = @consumer_name), @payload_hash
{{- else}} @message_id, @consumer_name, @message_type, @correlation_id, @payload_hash
{{- end}}{{if .Partitioned}}, @period{{end}}
WHERE {{if .Session}}pg_try_advisory_lock{{else}}pg_try_advisory_xact_lock{{end}}(hashtextextended(@lock_key, 0))
ON CONFLICT (message_id, {{if .Compact}}consumer_id{{else}}consumer_name{{end}}{{if .Partitioned}}, period{{end}}) DO NOTHING
