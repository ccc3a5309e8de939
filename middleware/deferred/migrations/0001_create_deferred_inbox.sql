-- The store-then-process inbox: one row per (message_id, consumer_name) received. The unique
-- key drops duplicate deliveries at receipt; workers claim pending rows later.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    -- The arrival sequence: monotonic in insert order, the default per-aggregate order.
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Producer-assigned message ID or business idempotency key; never a broker offset.
    message_id      text        NOT NULL,
    consumer_name   text        NOT NULL,
    -- The Watermill message UUID as received (it may differ from message_id).
    message_uuid    text        NOT NULL,
    -- Rows of one aggregate are handled one at a time, in order; NULL: no constraint.
    aggregate_key   text,
    -- The producer's sequence within the aggregate, when ordering by it.
    producer_seq    bigint,
    -- The topic the message was consumed from (for dead letters and replays).
    topic           text        NOT NULL DEFAULT '',
    payload         bytea       NOT NULL,
    -- SHA-256 of the payload: a same-key receipt with another hash is a key collision.
    payload_hash    bytea       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}',
    received_at     timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    -- Runs of the handler started (counted durably before each run, crashes included).
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    claimed_at      timestamptz,
    claimed_by      text,
    -- Fencing token of the current claim; a worker whose token no longer matches cannot
    -- start, mark done or fail the row.
    claim_token     uuid,
    -- The last handler error, truncated; never the payload.
    last_error      text,
    -- Set when the row became done: the retention purge deletes done rows by it.
    done_at         timestamptz,
    dead_at         timestamptz,
    UNIQUE (message_id, consumer_name)
);

-- The claim's unordered candidates: pending rows without an aggregate, in arrival order.
CREATE INDEX IF NOT EXISTS {{.FreeIndex}} ON {{.Table}} (consumer_name, id)
    WHERE status = 'pending' AND aggregate_key IS NULL;
-- Unfinished rows of each aggregate: the claim's skip scan over aggregates and each one's
-- head row in arrival order. Done rows leave it, so its size is the backlog, not the history.
CREATE INDEX IF NOT EXISTS {{.UnfinishedIndex}} ON {{.Table}} (consumer_name, aggregate_key, id)
    WHERE status <> 'done' AND aggregate_key IS NOT NULL;
-- Unfinished rows of each aggregate by producer sequence: the head row in sequence order.
CREATE INDEX IF NOT EXISTS {{.SequenceIndex}} ON {{.Table}} (consumer_name, aggregate_key, producer_seq, id)
    WHERE status <> 'done' AND producer_seq IS NOT NULL;
-- Every row by producer sequence: the probe for a head row's predecessor.
CREATE INDEX IF NOT EXISTS {{.PredecessorIndex}} ON {{.Table}} (consumer_name, aggregate_key, producer_seq)
    WHERE producer_seq IS NOT NULL;
-- Rows in flight: the claim's "aggregate busy" probe and the reaper.
CREATE INDEX IF NOT EXISTS {{.ProcessingIndex}} ON {{.Table}} (consumer_name, aggregate_key)
    WHERE status = 'processing';
-- Dead rows, for Stats and replay by status.
CREATE INDEX IF NOT EXISTS {{.DeadIndex}} ON {{.Table}} (consumer_name, dead_at)
    WHERE status = 'dead';
-- The retention purge of done rows (oldest first).
CREATE INDEX IF NOT EXISTS {{.DoneAtIndex}} ON {{.Table}} (done_at)
    WHERE status = 'done';
