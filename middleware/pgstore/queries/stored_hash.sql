-- The payload hash kept with a claim that exists: read for a duplicate, to tell it from a key
-- collision (the compact layout keeps the hash's first 2 bytes as a smallint). No row: the
-- claim found the key's lock held by a delivery in flight.
SELECT payload_hash FROM {{.Table}}
WHERE {{template "key" .}}
