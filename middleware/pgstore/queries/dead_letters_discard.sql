-- Deletes one batch of the dead-lettered records a DeadLetterFilter selects, oldest first, and
-- returns how many it deleted. The filter is checked again on the rows deleted, so a record
-- replayed or changed since the batch was chosen is left alone.
-- $1 consumer name, $2 reason (exact), $3 since (inclusive), $4 until (exclusive),
-- $5 message ID, $6 batch size; a NULL argument (but $6) selects everything.
WITH discarded AS (
    DELETE FROM {{.Attempts}}
    WHERE ctid IN (
            SELECT ctid FROM {{.Attempts}}
            WHERE dead_lettered_at IS NOT NULL
              AND ($1::text IS NULL OR consumer_name = $1)
              AND ($2::text IS NULL OR coalesce(dead_letter_reason, '') = $2)
              AND ($3::timestamptz IS NULL OR dead_lettered_at >= $3)
              AND ($4::timestamptz IS NULL OR dead_lettered_at < $4)
              AND ($5::text IS NULL OR message_id = $5)
            ORDER BY dead_lettered_at
            LIMIT $6)
      AND dead_lettered_at IS NOT NULL
      AND ($1::text IS NULL OR consumer_name = $1)
      AND ($2::text IS NULL OR coalesce(dead_letter_reason, '') = $2)
      AND ($3::timestamptz IS NULL OR dead_lettered_at >= $3)
      AND ($4::timestamptz IS NULL OR dead_lettered_at < $4)
      AND ($5::text IS NULL OR message_id = $5)
    RETURNING 1
)
SELECT count(*) FROM discarded
