-- The payload hash kept with an existing claim, and when it was stored (Unix seconds), read for
-- a duplicate. No row: the claim found the key's lock held by a delivery in flight.
SELECT payload_hash, extract(epoch FROM received_at)::float8 FROM {{.Table}} WHERE {{template "key" .}}
