-- Records a failed attempt that was not counted before its handler (@delta > 0), with the
-- handler's error, unless the key is processed or dead-lettered (then no row changes).
INSERT INTO {{.Attempts}} AS a (message_id, consumer_name, attempts, last_error)
SELECT @message_id::text, @consumer_name::text, @delta::integer, @last_error::text
WHERE NOT EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
ON CONFLICT (message_id, consumer_name) DO UPDATE
SET attempts = a.attempts + EXCLUDED.attempts, last_error = coalesce(EXCLUDED.last_error, a.last_error), last_attempt_at = now()
WHERE a.dead_lettered_at IS NULL
