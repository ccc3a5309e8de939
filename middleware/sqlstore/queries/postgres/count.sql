-- Counts one attempt for a key before its handler runs, in the count transaction (count.go),
-- which the claim's holder asks for. A dead-lettered key is not counted (no row changed).
INSERT INTO {{.Attempts}} AS a (message_id, consumer_name) VALUES (@message_id, @consumer_name)
ON CONFLICT (message_id, consumer_name) DO UPDATE
SET attempts = a.attempts + 1, last_attempt_at = now()
WHERE a.dead_lettered_at IS NULL
