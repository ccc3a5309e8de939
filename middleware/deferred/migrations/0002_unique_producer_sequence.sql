-- A producer sequence names one message per aggregate: a second message at a used number would
-- run after its successors (the number is done) or beside the first (it is not). The receipt's
-- INSERT ... ON CONFLICT DO NOTHING meets this index as it meets the unique key, so two
-- receipts at one number, even concurrent, store one row; the other is refused. The index has
-- the predecessor index's columns and replaces it (the claim's predecessor probe reads it).
-- It fails (SQLSTATE 23505) on a table that already holds a repeated number: see
-- docs/store-then-process.md, "Producer sequences", for the query that lists them.
CREATE UNIQUE INDEX IF NOT EXISTS {{.SlotIndex}} ON {{.Table}} (consumer_name, aggregate_key, producer_seq)
    WHERE producer_seq IS NOT NULL;
DROP INDEX IF EXISTS {{.QualifiedPredecessorIndex}};
