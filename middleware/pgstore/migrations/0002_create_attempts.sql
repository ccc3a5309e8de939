-- Delivery attempts of messages that have not been processed yet, counted durably so that a
-- poison message reaches the dead-letter topic after a bounded number of attempts even when
-- the consumer crashes between them. Kept apart from the processed-messages table:
-- "dead-lettered" and "processed" are different states.
CREATE TABLE IF NOT EXISTS {{.Attempts}} (
    message_id         text        NOT NULL,
    consumer_name      text        NOT NULL,
    -- Deliveries that reached the handler (or would have), including ones that crashed.
    attempts           integer     NOT NULL DEFAULT 1,
    first_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_attempt_at    timestamptz NOT NULL DEFAULT now(),
    -- The last handler error, truncated; never the payload.
    last_error         text,
    -- Set once the message was published to the dead-letter topic.
    dead_lettered_at   timestamptz,
    dead_letter_reason text,
    PRIMARY KEY (message_id, consumer_name)
);

CREATE INDEX IF NOT EXISTS {{.AttemptsDeadIndex}} ON {{.Attempts}} (dead_lettered_at)
    WHERE dead_lettered_at IS NOT NULL;
