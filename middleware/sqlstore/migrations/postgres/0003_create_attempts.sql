-- Attempts of messages not processed yet, counted durably (dead-letter topic), and the
-- dead-lettered keys.
CREATE TABLE IF NOT EXISTS {{.Attempts}} (
    message_id         text        NOT NULL,
    consumer_name      text        NOT NULL,
    attempts           integer     NOT NULL DEFAULT 1,
    first_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_attempt_at    timestamptz NOT NULL DEFAULT now(),
    last_error         text,
    dead_lettered_at   timestamptz,
    dead_letter_reason text,
    PRIMARY KEY (message_id, consumer_name)
)
