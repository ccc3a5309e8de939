-- The purge deletes oldest first through this index.
CREATE INDEX IF NOT EXISTS {{.ReceivedAtIndex}} ON {{.Table}} (received_at)
