-- The inbox: one row per (message_id, consumer_name) that a consumer has processed. The
-- primary key is the deduplication guarantee. The key columns are VARBINARY: compared byte
-- for byte, so two keys that differ only in case or in trailing spaces stay two keys (every
-- utf8mb4 collation of MariaDB 10.11 but the _nopad_ ones pads, utf8mb4_bin included: 'a'
-- and 'a ' collide). The store refuses keys that are not valid UTF-8 or are longer than the
-- columns before they reach the server.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    message_id     VARBINARY(512) NOT NULL,
    consumer_name  VARBINARY(128) NOT NULL,
    received_at    DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    message_type   VARCHAR(512)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    correlation_id VARCHAR(512)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    payload_hash   VARBINARY(32)  NULL,
    PRIMARY KEY (message_id, consumer_name),
    KEY {{.ReceivedAtIndex}} (received_at)
) ENGINE = InnoDB
