package pgstore

import (
	"context"
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
// until it commits, so run it in a quiet period; 1,000,000 rows took 83 s on a busy test
// machine), refuses with an exception, changing nothing, when a stored key cannot be
// converted (not a canonical lowercase UUID for the compact layout, not a UUIDv7 for
// partitioning by key time), renames the table to "<table>_old" (and its indexes), creates
// the new table (and its consumers table, and one partition per period present in the old
// rows), copies every row (in the compact layout the payload hash is cut to its first 2 bytes
// and received_at to its minute; message_type and correlation_id are not kept there), and keeps "<table>_old" for
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
		// Every migration, rendered for the new layout: the inbox table's create and any
		// later change to its row (the attempts table exists already, and its statements
		// keep it).
		fmt.Fprintf(&b, "\n-- %s, for the new layout\n%s\n", m.Name, strings.TrimSpace(m.SQL))
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
		n := dst.names
		n.Old = old
		b.WriteString(renderQuery("convert_consumers", n).sql)
		// The hash's first 2 bytes as a signed big-endian smallint; the minute received.
		cols := "message_id, consumer_id, payload_hash, received_minute"
		vals := "o.message_id::uuid, c.consumer_id, CASE WHEN length(o.payload_hash) >= 2 THEN (('x' || encode(substring(o.payload_hash FROM 1 FOR 2), 'hex') || '0000')::bit(32)::integer >> 16)::smallint END," +
			" floor(extract(epoch FROM o.received_at) / 60)::integer"
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

// DetectLayout reads the catalog (through q: a pool, a connection or a transaction) and
// returns cfg, with its Schema and Table defaulted, carrying the Layout and Partitioning of
// the existing inbox table: LayoutCompact when its message_id is of type uuid, else
// LayoutText; Partitioning set when the table is partitioned (relkind 'p'), with
// PartitionHourly when a partition is named "<table>_pYYYYMMDDHH", else PartitionDaily. The
// catalog does not record where a partitioned table's producer time comes from, so
// Partitioning.ProducerTime is set to ProducerTimeFromKey when the table is partitioned:
// right for purge, stats and partition maintenance, which claim nothing; a store that
// claims must be given its real source. The operator's CLI uses it so that purge, stats and
// layout convert work on any layout. It returns an error wrapping ErrNoTable for a table
// that does not exist, inbox.ErrInvalidConfig for invalid names, or the database's error.
func DetectLayout(ctx context.Context, q Querier, cfg Config) (Config, error) {
	s, err := newNames(Config{Schema: cfg.Schema, Table: cfg.Table})
	if err != nil {
		return cfg, err
	}
	cfg.Schema, cfg.Table = s.cfg.Schema, s.cfg.Table
	var kind, idType *string
	var hourly bool
	err = q.QueryRow(ctx, `
		SELECT c.relkind::text,
		       (SELECT format_type(a.atttypid, NULL) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'message_id' AND NOT a.attisdropped),
		       EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
		               WHERE i.inhparent = c.oid AND p.relname ~ ('^' || $2 || '_p[0-9]{10}$'))
		FROM (SELECT to_regclass($1) AS oid) r LEFT JOIN pg_class c ON c.oid = r.oid`, s.table, s.cfg.Table).Scan(&kind, &idType, &hourly)
	if err != nil {
		return cfg, fmt.Errorf("pgstore: detect the layout of %s: %w", s.table, err)
	}
	if kind == nil {
		return cfg, fmt.Errorf("%w: %s", ErrNoTable, s.table)
	}
	cfg.Layout, cfg.Partitioning = LayoutText, nil
	if idType != nil && *idType == "uuid" {
		cfg.Layout = LayoutCompact
	}
	if *kind == "p" {
		cfg.Partitioning = &Partitioning{Interval: PartitionDaily, ProducerTime: ProducerTimeFromKey}
		if hourly {
			cfg.Partitioning.Interval = PartitionHourly
		}
	}
	return cfg, nil
}

// ConversionCheck is what CheckConversion found, reading only.
type ConversionCheck struct {
	// Rows is the number of rows the conversion would copy.
	Rows int64
	// Unconvertible counts the rows whose message_id the new layout cannot hold (not a
	// canonical lowercase UUID for the compact layout, not a UUIDv7 for partitioning by key
	// time): the conversion would refuse and change nothing while it is above zero.
	Unconvertible int64
	// Periods is the number of partitions the conversion would create (partitioned targets):
	// one per producer-time period present in the rows.
	Periods int64
	// OldTable is the quoted "<table>_old" the conversion renames the table to; OldTableExists
	// reports that a table of that name exists already (a conversion done before and not
	// cleaned up), which makes the conversion fail: drop or rename it first.
	OldTable       string
	OldTableExists bool
}

// CheckConversion reads, through q, what LayoutMigrationSQL(from, to) would do to the table,
// changing nothing: the rows to copy, the keys it would refuse, the partitions it would
// create and whether "<table>_old" is already taken. It counts over the whole table (a
// sequential scan). Errors: those of LayoutMigrationSQL (wrapping inbox.ErrInvalidConfig) for
// a conversion it does not do, or the database's.
func CheckConversion(ctx context.Context, q Querier, from, to Config) (ConversionCheck, error) {
	var c ConversionCheck
	if _, err := LayoutMigrationSQL(from, to); err != nil {
		return c, err
	}
	dst, err := newNames(to)
	if err != nil {
		return c, err
	}
	c.OldTable = pgx.Identifier{dst.cfg.Schema, dst.cfg.Table + "_old"}.Sanitize()
	pattern := uuidPattern
	period := "NULL::timestamptz"
	if p := dst.cfg.Partitioning; p != nil {
		pattern = uuidV7Pattern
		unit := "day"
		if p.Interval == PartitionHourly {
			unit = "hour"
		}
		period = fmt.Sprintf("CASE WHEN message_id ~ $1 THEN date_trunc('%s', to_timestamp(('x' || substr(replace(message_id, '-', ''), 1, 12))::bit(48)::bigint / 1000.0) AT TIME ZONE 'UTC') END", unit)
	}
	err = q.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE message_id !~ $1), count(DISTINCT "+period+"), to_regclass($2) IS NOT NULL FROM "+dst.table,
		pattern, c.OldTable).Scan(&c.Rows, &c.Unconvertible, &c.Periods, &c.OldTableExists)
	if err != nil {
		return c, fmt.Errorf("pgstore: check the conversion of %s: %w", dst.table, err)
	}
	return c, nil
}
