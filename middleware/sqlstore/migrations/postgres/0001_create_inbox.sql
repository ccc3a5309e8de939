-- The inbox: one row per (message_id, consumer_name) that a consumer has processed. The
-- primary key is the deduplication guarantee; received_at serves the purge. The same columns
-- as pgstore's text layout.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    message_id     text        NOT NULL,
    consumer_name  text        NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    message_type   text,
    correlation_id text,
    payload_hash   bytea,
    PRIMARY KEY (message_id, consumer_name)
)
