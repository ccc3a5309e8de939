-- Records a failed attempt not counted before its handler (@delta > 0), with the handler's
-- error, unless the key is processed or dead-lettered (then no row changes).
INSERT INTO {{.Attempts}} (message_id, consumer_name, attempts, last_error)
SELECT @message_id, @consumer_name, @delta, @last_error FROM DUAL
WHERE NOT EXISTS (SELECT 1 FROM {{.Table}} WHERE {{template "key" .}})
ON DUPLICATE KEY UPDATE
  last_error = IF(dead_lettered_at IS NULL, COALESCE(VALUES(last_error), last_error), last_error),
  last_attempt_at = IF(dead_lettered_at IS NULL, CURRENT_TIMESTAMP(6), last_attempt_at),
  attempts = IF(dead_lettered_at IS NULL, attempts + VALUES(attempts), attempts)
