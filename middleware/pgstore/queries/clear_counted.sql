-- Deletes the attempt record of a delivery that counted first (count_first.sql), inside its
-- claim's transaction, in the claim's round trip: it is gone if and only if the claim commits
-- (the handler ran to its end); a rollback or a crash keeps the count. Only this delivery's own
-- count is deleted (its token): when the count found the key's lock held, the record is the
-- holder's, and neither waited for nor touched (under REPEATABLE READ, touching a record the
-- holder deletes would fail with SQLSTATE 40001).
DELETE FROM {{.Attempts}}
WHERE message_id = @message_id AND consumer_name = @consumer_name AND count_token = @count_token
  AND dead_lettered_at IS NULL
