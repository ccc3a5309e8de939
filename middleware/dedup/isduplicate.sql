-- IsDuplicate: record the key for the consumer, or find it recorded within the window.
-- $1 the key (message_id), $2 the consumer name, $3 the window in microseconds.
-- A row comes back when the key is new, or its record is older than the window (it is then
-- renewed): not a duplicate. No row: recorded within the window, a duplicate.
-- The primary key (message_id, consumer_name) serialises concurrent copies: one inserts, the
-- others wait for its commit and then find the row.
INSERT INTO {{.Table}} AS t (message_id, consumer_name, received_at)
VALUES ($1, $2, now())
ON CONFLICT (message_id, consumer_name) DO UPDATE SET received_at = now()
    WHERE t.received_at < now() - $3::bigint * interval '1 microsecond'
RETURNING 1
