-- The payload hash kept with an existing claim, and when it was stored (Unix seconds; the
-- DATETIME is read in the session's time zone, as CURRENT_TIMESTAMP(6) wrote it), read for a
-- duplicate.
SELECT payload_hash, UNIX_TIMESTAMP(received_at) FROM {{.Table}} WHERE {{template "key" .}}
