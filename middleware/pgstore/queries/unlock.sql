-- Releases the session-level lock of a claim counted before its handler (claim.sql with
-- .Session), once its transaction has ended.
SELECT pg_advisory_unlock(hashtextextended(@lock_key, 0))
