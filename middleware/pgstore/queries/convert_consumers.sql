-- Layout conversion to the compact layout: every consumer name of the old table gets its
-- smallint, in name order; names already registered keep theirs.
INSERT INTO {{.Consumers}} (consumer_name) SELECT DISTINCT consumer_name FROM {{.Old}} ORDER BY 1 ON CONFLICT DO NOTHING;
