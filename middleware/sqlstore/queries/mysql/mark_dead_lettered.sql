-- Records that the key was published to the dead-letter topic, creating the record when no
-- attempt was counted.
INSERT INTO {{.Attempts}} (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason)
VALUES (@message_id, @consumer_name, 0, CURRENT_TIMESTAMP(6), @reason)
ON DUPLICATE KEY UPDATE dead_lettered_at = CURRENT_TIMESTAMP(6), dead_letter_reason = VALUES(dead_letter_reason)
