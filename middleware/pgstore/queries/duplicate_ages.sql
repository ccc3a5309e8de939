-- The duplicate-age histogram of every consumer (migration 0005, duplicate_age.sql), its
-- buckets in order.
SELECT consumer_name, lower_seconds, upper_seconds, duplicates, max_age_seconds, last_at
FROM {{.DuplicateAges}}
ORDER BY consumer_name, lower_seconds
