-- The payload hash kept with an existing claim, read for a duplicate.
SELECT payload_hash FROM {{.Table}} WHERE {{template "key" .}}
