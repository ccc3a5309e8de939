package pgstore

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// uuidPattern and uuidV7Pattern match canonical lowercase UUIDs, any version and version 7.
const (
	uuidPattern   = `^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`
	uuidV7Pattern = `^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`
)

// LayoutMigrationSQL returns a script that converts an existing inbox table of the text
// layout, not partitioned (from, the store it was created by), into the layout and mode of
// to (same schema and table name): LayoutCompact, partitioned with ProducerTimeFromKey, or
// both. Nothing converts silently: a store whose table has another layout refuses to start
// (Migrate returns an error wrapping inbox.ErrInvalidConfig) until the script has run.
//
// The script runs in one transaction. It locks the table (ACCESS EXCLUSIVE: claims wait
// until it commits, so run it in a quiet period; it copies about 1,000,000 rows in tens of
// seconds), refuses with an exception, changing nothing, when a stored key cannot be
// converted (not a canonical lowercase UUID for the compact layout, not a UUIDv7 for
// partitioning by key time), renames the table to "<table>_old" (and its indexes), creates
// the new table (and its consumers table, and one partition per period present in the old
// rows), copies every row (the payload hash is cut to its first 4 bytes in the compact
// layout; message_type and correlation_id are not kept there), and keeps "<table>_old" for
// you to compare and then drop. The attempts table is unchanged.
//
// Partitioning by ProducerTimeFromClaim cannot be converted to: the producer times of stored
// rows are unknown, and guessing them (from received_at) could file a row under a period its
// later copies do not use. Start such a table empty beside the old one instead (a new table
// name) and keep the old one until the retention window has passed; docs/retention.md says
// how. Errors wrap inbox.ErrInvalidConfig.
func LayoutMigrationSQL(from, to Config) (string, error) {
	src, err := newNames(from)
	if err != nil {
		return "", err
	}
	dst, err := newNames(to)
	if err != nil {
		return "", err
	}
	switch {
	case src.cfg.Layout != LayoutText || src.cfg.Partitioning != nil:
		return "", fmt.Errorf("%w: pgstore: LayoutMigrationSQL converts from the text layout, not partitioned", inbox.ErrInvalidConfig)
	case src.cfg.Schema != dst.cfg.Schema || src.cfg.Table != dst.cfg.Table:
		return "", fmt.Errorf("%w: pgstore: LayoutMigrationSQL converts a table in place: from and to must name the same schema and table", inbox.ErrInvalidConfig)
	case dst.cfg.Layout == LayoutText && dst.cfg.Partitioning == nil:
		return "", fmt.Errorf("%w: pgstore: LayoutMigrationSQL: nothing to convert (to is the text layout, not partitioned)", inbox.ErrInvalidConfig)
	case dst.cfg.Partitioning != nil && dst.cfg.Partitioning.ProducerTime != ProducerTimeFromKey:
		return "", fmt.Errorf("%w: pgstore: LayoutMigrationSQL: a table partitioned by ProducerTimeFromClaim cannot be converted to (stored rows have no producer time); start it as a new table (docs/retention.md)", inbox.ErrInvalidConfig)
	}
	ms, err := dst.Migrations()
	if err != nil {
		return "", err
	}
	schema := pgx.Identifier{to.Schema}.Sanitize()
	if to.Schema == "" {
		schema = pgx.Identifier{DefaultSchema}.Sanitize()
	}
	name := dst.cfg.Table
	old := pgx.Identifier{dst.cfg.Schema, name + "_old"}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- watermill-inbox: convert %s from the text layout to the %s layout", dst.table, dst.cfg.Layout)
	if p := dst.cfg.Partitioning; p != nil {
		fmt.Fprintf(&b, ", partitioned %s by the timestamp of UUIDv7 keys", p.Interval)
	}
	b.WriteString(".\n-- Claims wait while it runs. The old rows stay in " + old + " until you drop it.\nBEGIN;\n")
	fmt.Fprintf(&b, "LOCK TABLE %s IN ACCESS EXCLUSIVE MODE;\n", dst.table)
	pattern, what := uuidPattern, "a canonical lowercase UUID"
	if dst.cfg.Partitioning != nil {
		pattern, what = uuidV7Pattern, "a canonical lowercase UUIDv7"
	}
	fmt.Fprintf(&b, `DO $convert$
BEGIN
    IF EXISTS (SELECT 1 FROM %s WHERE message_id !~ %s) THEN
        RAISE EXCEPTION 'watermill-inbox: %%s rows of %s have a message_id that is not %s; nothing was converted',
            (SELECT count(*) FROM %s WHERE message_id !~ %s);
    END IF;
END
$convert$;
`, dst.table, quoteLiteral(pattern), strings.ReplaceAll(dst.table, "'", "''"), what, dst.table, quoteLiteral(pattern))
	fmt.Fprintf(&b, "ALTER TABLE %s RENAME TO %s;\n", dst.table, pgx.Identifier{name + "_old"}.Sanitize())
	fmt.Fprintf(&b, "ALTER INDEX %s.%s RENAME TO %s;\n", schema, pgx.Identifier{name + "_received_at_idx"}.Sanitize(), pgx.Identifier{name + "_ra_old"}.Sanitize())
	fmt.Fprintf(&b, "ALTER INDEX %s.%s RENAME TO %s;\n", schema, pgx.Identifier{name + "_pkey"}.Sanitize(), pgx.Identifier{name + "_pk_old"}.Sanitize())
	for _, m := range ms {
		if m.Version == 1 {
			fmt.Fprintf(&b, "\n-- %s, for the new layout\n%s\n", m.Name, strings.TrimSpace(m.SQL))
		}
	}
	period := ""
	if p := dst.cfg.Partitioning; p != nil {
		unit := "day"
		if p.Interval == PartitionHourly {
			unit = "hour"
		}
		// The UUIDv7's first 48 bits are Unix milliseconds.
		period = fmt.Sprintf("date_trunc('%s', to_timestamp(('x' || substr(replace(message_id, '-', ''), 1, 12))::bit(48)::bigint / 1000.0) AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'", unit)
		format, step := "YYYYMMDD", "1 day"
		if p.Interval == PartitionHourly {
			format, step = "YYYYMMDDHH24", "1 hour"
		}
		fmt.Fprintf(&b, `DO $convert$
DECLARE p timestamptz;
BEGIN
    FOR p IN SELECT DISTINCT %s FROM %s LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS %%I.%%I PARTITION OF %s FOR VALUES FROM (%%L) TO (%%L)',
            %s, %s || '_p' || to_char(p AT TIME ZONE 'UTC', '%s'), p, p + interval '%s');
    END LOOP;
END
$convert$;
`, period, old, strings.ReplaceAll(dst.table, "'", "''"), quoteLiteral(dst.cfg.Schema), quoteLiteral(name), format, step)
	}
	if dst.cfg.Layout == LayoutCompact {
		fmt.Fprintf(&b, "INSERT INTO %s (consumer_name) SELECT DISTINCT consumer_name FROM %s ORDER BY 1 ON CONFLICT DO NOTHING;\n", dst.consumers, old)
		cols := "message_id, consumer_id, payload_hash, received_at"
		vals := "o.message_id::uuid, c.consumer_id, CASE WHEN length(o.payload_hash) >= 4 THEN ('x' || encode(substring(o.payload_hash FROM 1 FOR 4), 'hex'))::bit(32)::integer END, o.received_at"
		if period != "" {
			cols += ", period"
			vals += ", " + strings.ReplaceAll(period, "message_id", "o.message_id")
		}
		fmt.Fprintf(&b, "INSERT INTO %s (%s)\nSELECT %s\nFROM %s o JOIN %s c USING (consumer_name);\n", dst.table, cols, vals, old, dst.consumers)
	} else {
		fmt.Fprintf(&b, "INSERT INTO %s (message_id, consumer_name, received_at, period, message_type, correlation_id, payload_hash)\n"+
			"SELECT message_id, consumer_name, received_at, %s, message_type, correlation_id, payload_hash FROM %s;\n", dst.table, period, old)
	}
	fmt.Fprintf(&b, "COMMIT;\n-- Then: run the PartitionManager or `watermill-inbox partitions ensure` (partitioned), check the row counts, and DROP TABLE %s.\n", old)
	return b.String(), nil
}
