-- The dead-lettered records a DeadLetterFilter selects, oldest first.
-- $1 consumer name, $2 reason (exact), $3 since (inclusive), $4 until (exclusive),
-- $5 message ID, $6 limit; a NULL argument selects everything.
SELECT message_id, consumer_name, attempts, coalesce(dead_letter_reason, ''), coalesce(last_error, ''), dead_lettered_at
FROM {{.Attempts}}
WHERE dead_lettered_at IS NOT NULL
  AND ($1::text IS NULL OR consumer_name = $1)
  AND ($2::text IS NULL OR coalesce(dead_letter_reason, '') = $2)
  AND ($3::timestamptz IS NULL OR dead_lettered_at >= $3)
  AND ($4::timestamptz IS NULL OR dead_lettered_at < $4)
  AND ($5::text IS NULL OR message_id = $5)
ORDER BY dead_lettered_at, consumer_name, message_id
LIMIT $6
