-- Releases the key's session-level lock taken by count_first.sql, once the delivery's claim
-- transaction has ended and its count is settled.
SELECT pg_advisory_unlock(hashtextextended(@lock_key, 0))
