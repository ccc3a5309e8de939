-- The insert-first claim of one key, under the key's lock (get_lock.sql). 1 row affected:
-- inserted; 0: a duplicate (the no-op update changes nothing, and the connection must not
-- set CLIENT_FOUND_ROWS, which would report it as 1). Unlike INSERT IGNORE, an over-long or
-- mis-encoded value is an error, never a warning with the value truncated.
INSERT INTO {{.Table}} (message_id, consumer_name, message_type, correlation_id, payload_hash)
VALUES (@message_id, @consumer_name, @message_type, @correlation_id, @payload_hash)
ON DUPLICATE KEY UPDATE message_id = message_id
