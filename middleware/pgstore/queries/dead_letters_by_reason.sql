-- The dead-lettered records a DeadLetterFilter selects, grouped by consumer and reason: how
-- many, when the first and the last were dead-lettered; the group seen first comes first.
-- $1 consumer name, $2 reason (exact), $3 since (inclusive), $4 until (exclusive),
-- $5 message ID, $6 limit (of groups); a NULL argument selects everything.
SELECT consumer_name, coalesce(dead_letter_reason, '') AS reason, count(*), min(dead_lettered_at), max(dead_lettered_at)
FROM {{.Attempts}}
WHERE dead_lettered_at IS NOT NULL
  AND ($1::text IS NULL OR consumer_name = $1)
  AND ($2::text IS NULL OR coalesce(dead_letter_reason, '') = $2)
  AND ($3::timestamptz IS NULL OR dead_lettered_at >= $3)
  AND ($4::timestamptz IS NULL OR dead_lettered_at < $4)
  AND ($5::text IS NULL OR message_id = $5)
GROUP BY consumer_name, reason
ORDER BY min(dead_lettered_at), consumer_name, reason
LIMIT $6
