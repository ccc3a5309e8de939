-- The insert-first claim of one key, the first statement of the inbox transaction (as in
-- pgstore): the key's transaction-level advisory lock is tried, never waited for. Zero rows
-- and no stored row (stored_hash.sql): the key is held by a delivery in flight; zero rows and
-- a stored row: a duplicate. ON CONFLICT DO NOTHING never raises 23505.
INSERT INTO {{.Table}} (message_id, consumer_name, message_type, correlation_id, payload_hash)
SELECT @message_id::text, @consumer_name::text, @message_type::text, @correlation_id::text, @payload_hash::bytea
WHERE pg_try_advisory_xact_lock(hashtextextended(@lock_name::text, 0))
ON CONFLICT (message_id, consumer_name) DO NOTHING
