-- Adds the age of a duplicate to its consumer's histogram (migration 0005): sent after the
-- rollback of a claim that found its key stored, in the same round trip, so it costs the
-- duplicate no round trip and a processed message nothing. The age is the database's now()
-- minus the stored row's received time (in the compact layout the start of its minute, so ages
-- are to the minute there). No stored row (the key's lock was held by a delivery in flight):
-- nothing is added. Its implicit transaction commits asynchronously (set_config, local to it):
-- a duplicate costs no WAL flush, and concurrent duplicates of one bucket hold its row only for
-- the statement; a crash of the PostgreSQL server within wal_writer_delay can lose a few
-- counts.
--
-- The buckets' lower bounds, in seconds: 0, 1 s, 10 s, 1 min, 5 min, 15 min, 1 h, 4 h, 12 h,
-- 1, 2, 3, 7, 14, 30 and 60 days; each bucket ends at the next bound, the last has none (the
-- bounds of inboxmetrics.DuplicateAgeBuckets: the steps a retention window is chosen in).
WITH d AS (
  SELECT b.bounds, b.age, width_bucket(b.age, b.bounds) AS i
  FROM (
    SELECT '{0,1,10,60,300,900,3600,14400,43200,86400,172800,259200,604800,1209600,2592000,5184000}'::float8[] AS bounds,
           greatest(extract(epoch FROM now() - {{if .Compact}}to_timestamp(received_minute * 60::float8){{else}}received_at{{end}})::float8, 0) AS age
    FROM {{.Table}}
    WHERE {{template "key" .}}
  ) b
)
INSERT INTO {{.DuplicateAges}} AS h (consumer_name, lower_seconds, upper_seconds, duplicates, max_age_seconds, last_at)
SELECT @consumer_name, d.bounds[d.i], d.bounds[d.i + 1], 1, d.age, now()
FROM d, (SELECT set_config('synchronous_commit', 'off', true)) AS async
ON CONFLICT (consumer_name, lower_seconds) DO UPDATE
SET duplicates = h.duplicates + 1,
    max_age_seconds = greatest(h.max_age_seconds, EXCLUDED.max_age_seconds),
    last_at = EXCLUDED.last_at
