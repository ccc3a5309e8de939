-- The payload hash kept with a claim that exists, and when it was stored: read for a
-- duplicate, to tell it from a key collision (the compact layout keeps the hash's first 2
-- bytes as a smallint, and the minute it was received) and to report its age. No row: the
-- claim found the key's lock held by a delivery in flight.
SELECT payload_hash, {{if .Compact}}to_timestamp(received_minute * 60::float8){{else}}received_at{{end}} FROM {{.Table}}
WHERE {{template "key" .}}
