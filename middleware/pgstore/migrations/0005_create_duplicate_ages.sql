-- How old the duplicates were when they arrived, per consumer: a histogram of fixed buckets,
-- one row per consumer and bucket that has seen a duplicate. A duplicate's claim adds its age
-- (the claim's time minus the stored row's received time) to its bucket after the claim's
-- rollback (queries/duplicate_age.sql); a processed message never touches it. The stats read
-- it (queries/duplicate_ages.sql) to show the ages' p50, p99 and max beside the retention
-- window. The buckets' bounds are in queries/duplicate_age.sql; each row carries its own, so a
-- change of the bounds never misreads rows written before it.
CREATE TABLE IF NOT EXISTS {{.DuplicateAges}} (
    consumer_name   text             NOT NULL,
    -- The bucket: ages of at least lower_seconds and below upper_seconds (NULL: no bound).
    lower_seconds   double precision NOT NULL,
    upper_seconds   double precision,
    duplicates      bigint           NOT NULL,
    -- The oldest duplicate seen in the bucket, exact (seconds).
    max_age_seconds double precision NOT NULL,
    -- When the bucket last counted a duplicate.
    last_at         timestamptz      NOT NULL,
    PRIMARY KEY (consumer_name, lower_seconds)
);
