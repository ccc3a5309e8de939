-- The inbox: one row per (message_id, consumer_name) that a consumer has processed.
-- The primary key is the deduplication guarantee; received_at serves the time-based purge.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    -- Producer-assigned message ID or business idempotency key, set once when the event was
    -- created. Never a broker offset, receipt handle or delivery counter.
    message_id     text        NOT NULL,
    -- The handler that processed it; several handlers share one table without blocking.
    consumer_name  text        NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    -- Debugging metadata; not part of deduplication.
    message_type   text,
    correlation_id text,
    payload_hash   bytea,
    PRIMARY KEY (message_id, consumer_name)
);

CREATE INDEX IF NOT EXISTS {{.ReceivedAtIndex}} ON {{.Table}} (received_at);
