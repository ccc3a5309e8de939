-- The count transaction commits asynchronously: a count survives any crash of the consumer;
-- only a crash of the server within wal_writer_delay can lose it (one extra attempt).
SET LOCAL synchronous_commit = off
