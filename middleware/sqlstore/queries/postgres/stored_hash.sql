-- The payload hash kept with an existing claim, read for a duplicate. No row: the claim found
-- the key's lock held by a delivery in flight.
SELECT payload_hash FROM {{.Table}} WHERE {{template "key" .}}
