{{- if .Compact -}}
-- The compact layout's row, version 2: 24 bytes of data instead of 32, so a row costs 52 heap
-- bytes instead of 60 (tuple header 24 + data 24 + line pointer 4). The time a row was
-- received is kept as whole minutes since 1970-01-01 UTC in an integer (4 bytes; good until
-- the year 6053) instead of a timestamptz (8 bytes), and the payload hash prefix is its first
-- 2 bytes in a smallint (it fills the alignment gap after consumer_id). Columns: message_id
-- uuid 16, consumer_id smallint 2, payload_hash smallint 2, received_minute integer 4.
--
-- It converts a compact table made by the first version in place (ALTER TABLE rewrites it
-- under an ACCESS EXCLUSIVE lock: claims wait until it commits) and does nothing to a table
-- that has the new row already, so it can run more than once.
DO $compact_v2$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{.TableLiteral}}::regclass AND attname = 'received_at' AND NOT attisdropped) THEN
        ALTER TABLE {{.Table}}
            ALTER COLUMN payload_hash TYPE smallint USING (payload_hash >> 16)::smallint,
            ALTER COLUMN received_at DROP DEFAULT,
            ALTER COLUMN received_at TYPE integer USING floor(extract(epoch FROM received_at) / 60)::integer;
        ALTER TABLE {{.Table}} RENAME COLUMN received_at TO received_minute;
        ALTER TABLE {{.Table}} ALTER COLUMN received_minute SET DEFAULT floor(extract(epoch FROM now()) / 60)::integer;
    END IF;
END
$compact_v2$;
{{- else -}}
-- The compact layout's row, version 2 (nothing to change in the text layout).
SELECT 1;
{{- end}}
