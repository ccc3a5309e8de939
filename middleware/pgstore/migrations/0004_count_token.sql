-- The token of the last count made before a handler (queries/count_first.sql), a random number
-- the consumer chose: when the answer to a claim's round trip is lost after the count may have
-- committed, the consumer ends the server process that ran it and takes the count back only if
-- the record still carries the token (queries/take_back_lost.sql), so a failed claim does not
-- use up an attempt. NULL once taken back, and for counts made otherwise.
ALTER TABLE {{.Attempts}} ADD COLUMN IF NOT EXISTS count_token bigint;
