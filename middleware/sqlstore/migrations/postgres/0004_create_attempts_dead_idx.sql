-- Dead letters listed by time.
CREATE INDEX IF NOT EXISTS {{.AttemptsDeadIndex}} ON {{.Attempts}} (dead_lettered_at)
    WHERE dead_lettered_at IS NOT NULL
