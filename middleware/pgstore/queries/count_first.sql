-- Counts one attempt of a delivery that counts first (its broker does not mark it as a first
-- delivery), before its handler runs. It is the statement of a transaction of its own, sent in
-- the claim's round trip ahead of the claim's BEGIN (claim.go) after SET LOCAL
-- synchronous_commit = off: it commits asynchronously, so the count survives the claim's
-- rollback and any crash of the consumer. It counts only if it takes the key's lock, for the
-- session: no copy of the message in flight counts meanwhile, and the lock outlives this
-- transaction and a statement of the handler that aborts the claim's (an aborted transaction
-- releases its transaction-level locks at once); unlock.sql releases it once the delivery has
-- settled. The claim that follows tries the key's transaction-level lock, which a session
-- holding the session lock always gets. A dead-lettered key is not counted. It returns the
-- key's record afterwards; no row: not counted (the lock was held by a delivery in flight, or
-- the key is dead-lettered), which unlock_if_held.sql then tells apart. @count_token marks the
-- count for take_back_lost.sql.
INSERT INTO {{.Attempts}} AS a (message_id, consumer_name, count_token)
SELECT @message_id, @consumer_name, @count_token
WHERE pg_try_advisory_lock(hashtextextended(@lock_key, 0))
ON CONFLICT (message_id, consumer_name) DO UPDATE
SET attempts = a.attempts + 1, last_attempt_at = now(), count_token = EXCLUDED.count_token
WHERE a.dead_lettered_at IS NULL
RETURNING a.attempts, a.last_error
