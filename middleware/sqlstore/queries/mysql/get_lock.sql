-- The key's lock, tried and never waited for (timeout 0), before the inbox transaction
-- begins. MySQL has no transaction-level advisory lock: GET_LOCK is held by the session
-- until RELEASE_LOCK (release_lock.sql, after COMMIT or ROLLBACK) or the session's end. 1:
-- taken; 0: a delivery in flight holds it; NULL: an error.
SELECT GET_LOCK(@lock_name, 0)
