-- Records that the key was published to the dead-letter topic, creating the record when no
-- attempt was counted.
INSERT INTO {{.Attempts}} AS a (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason)
VALUES (@message_id, @consumer_name, 0, now(), @reason)
ON CONFLICT (message_id, consumer_name) DO UPDATE
SET dead_lettered_at = now(), dead_letter_reason = EXCLUDED.dead_letter_reason
