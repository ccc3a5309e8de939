-- Tries the key's advisory lock for the session, in a READ COMMITTED transaction of its own
-- ahead of a counting claim under REPEATABLE READ or SERIALIZABLE (claim.go): the claim's
-- snapshot is then taken after the lock, so its read of the attempt record (record.sql) sees
-- what the delivery that held the key before recorded. Released by unlock.sql once the
-- delivery has settled; the claim's transaction-level try then always succeeds for the session.
SELECT pg_try_advisory_lock(hashtextextended(@lock_key, 0))
