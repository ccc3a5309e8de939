-- Releases the key's session-level lock if this session holds it, and says whether it did:
-- after count_first.sql counted nothing, which happens both when another delivery held the
-- lock and when the key is dead-lettered (pg_advisory_unlock alone would log a warning in the
-- first case). An advisory lock on a bigint key is listed in pg_locks with its high 32 bits as
-- classid, its low 32 bits as objid and objsubid 1 (PostgreSQL's documentation, pg_locks).
SELECT CASE WHEN EXISTS (
  SELECT 1 FROM pg_locks
  WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
    AND classid = ((hashtextextended(@lock_key, 0) >> 32) & 4294967295)::oid
    AND objid = (hashtextextended(@lock_key, 0) & 4294967295)::oid
    AND mode = 'ExclusiveLock'
) THEN pg_advisory_unlock(hashtextextended(@lock_key, 0)) ELSE false END
