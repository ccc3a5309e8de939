-- Attempts of messages not processed yet, counted durably (dead-letter topic), and the
-- dead-lettered keys.
CREATE TABLE IF NOT EXISTS {{.Attempts}} (
    message_id         VARBINARY(512) NOT NULL,
    consumer_name      VARBINARY(128) NOT NULL,
    attempts           INT            NOT NULL DEFAULT 1,
    first_attempt_at   DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_attempt_at    DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_error         TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    dead_lettered_at   DATETIME(6)    NULL,
    dead_letter_reason VARCHAR(1024)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    PRIMARY KEY (message_id, consumer_name),
    KEY {{.AttemptsDeadIndex}} (dead_lettered_at)
) ENGINE = InnoDB
