-- Counts one attempt for each key, before its handler runs, in a transaction of its own that
-- commits asynchronously (the connection runs with synchronous_commit off): it survives the
-- claim's rollback and a crash of the consumer. One statement counts the keys of every
-- delivery that asked since the last one ran (group commit of the counts). Only the holder of
-- a key's claim asks, so no copy of the message is counted meanwhile. A dead-lettered key is
-- not counted and not returned.
INSERT INTO {{.Attempts}} AS a (message_id, consumer_name)
SELECT * FROM unnest(@message_ids::text[], @consumer_names::text[])
ON CONFLICT (message_id, consumer_name) DO UPDATE
SET attempts = a.attempts + 1, last_attempt_at = now()
WHERE a.dead_lettered_at IS NULL
RETURNING message_id, consumer_name, attempts
