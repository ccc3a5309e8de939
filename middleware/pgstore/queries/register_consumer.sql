-- Compact layout: gives a consumer name its smallint, taking an identity value only when the
-- name is missing, so restarts do not use up the 32,767 values.
INSERT INTO {{.Consumers}} (consumer_name)
SELECT @consumer_name::text
WHERE NOT EXISTS (SELECT 1 FROM {{.Consumers}} WHERE consumer_name = @consumer_name::text)
ON CONFLICT (consumer_name) DO NOTHING
