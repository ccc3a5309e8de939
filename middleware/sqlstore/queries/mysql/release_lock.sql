-- Releases the key's lock once the inbox transaction has ended.
SELECT RELEASE_LOCK(@lock_name)
