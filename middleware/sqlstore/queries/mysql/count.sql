-- Counts one attempt for a key before its handler runs, in the count transaction (count.go).
-- A dead-lettered key is left as it is (no row changed).
INSERT INTO {{.Attempts}} (message_id, consumer_name) VALUES (@message_id, @consumer_name)
ON DUPLICATE KEY UPDATE
  attempts = IF(dead_lettered_at IS NULL, attempts + 1, attempts),
  last_attempt_at = IF(dead_lettered_at IS NULL, CURRENT_TIMESTAMP(6), last_attempt_at)
