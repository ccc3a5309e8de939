package pgstore

import (
	"context"
	"embed"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/migrate"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrationsTable records applied migrations per inbox table, in the inbox table's schema.
const migrationsTable = migrate.VersionsTable

// Migration is one versioned schema change, rendered for a configured schema and table.
type Migration struct {
	// Version is the migration's number, starting at 1, from its file name.
	Version int
	// Name is the file name, e.g. "0001_create_processed_messages.sql".
	Name string
	// SQL is the statement text with quoted identifiers substituted.
	SQL string
}

type migrationNames struct {
	Table             string
	TableLiteral      string // Table as a SQL string literal, for ::regclass
	ReceivedAtIndex   string
	Attempts          string
	AttemptsDeadIndex string
	Consumers         string
	DuplicateAges     string
	Compact           bool
	Partitioned       bool
}

// migrations is the store's set for the shared runner (internal/migrate): its files rendered
// for its names, recorded under its quoted table, checked for the inbox, attempts and
// version tables.
func (s *Store) migrations() migrate.Set {
	return migrate.Set{
		Prefix: "pgstore",
		Files:  migrationFiles,
		Dir:    "migrations",
		Data: migrationNames{
			Table:             s.table,
			TableLiteral:      quoteLiteral(s.table),
			ReceivedAtIndex:   pgx.Identifier{s.cfg.Table + "_received_at_idx"}.Sanitize(),
			Attempts:          s.attempts,
			AttemptsDeadIndex: pgx.Identifier{s.cfg.Table + "_dead_idx"}.Sanitize(),
			Consumers:         s.consumers,
			DuplicateAges:     s.duplicateAges,
			Compact:           s.cfg.Layout == LayoutCompact,
			Partitioned:       s.cfg.Partitioning != nil,
		},
		Schema: s.cfg.Schema,
		Table:  s.table,
		Tables: []string{s.table, s.attempts, s.duplicateAges},
	}
}

// Migrations returns the store's migrations in version order, rendered for its schema and
// table. Use MigrationSQL to get them as one script.
func (s *Store) Migrations() ([]Migration, error) {
	ms, err := s.migrations().Migrations()
	if err != nil {
		return nil, err
	}
	return migrate.Converted[Migration](ms), nil
}

// MigrationSQL returns every migration as one SQL script, for users who run their own
// migration tool. The script creates the schema when missing, creates the version table and
// records each version, so a later Migrate call sees them applied and does nothing.
func (s *Store) MigrationSQL() (string, error) {
	return s.migrations().Script("watermill-inbox schema")
}

// Migrate first checks, reading only, whether anything is pending (CheckSchema); when nothing
// is, it verifies the inbox key and returns, having written nothing, so an application role
// without CREATE may call it at start-up. Otherwise it applies pending migrations in one
// transaction, under a transaction-level advisory lock (pg_advisory_xact_lock), so it is safe
// when several instances start at once. It creates the schema when it does not exist (needing
// CREATE on the database only then), and verifies that the inbox table has the configured
// layout (see verifyKey): an error wrapping inbox.ErrInvalidConfig reports a pre-existing
// table of the same name with another layout or other keys. In partitioned mode it then
// creates the partitions of the previous, current and next periods (PartitionManager keeps
// the rest: the lead and the window). It returns the versions it applied (none when the
// schema is current) or the first error, after which nothing is applied.
func (s *Store) Migrate(ctx context.Context) (applied []int, err error) {
	applied, locked, err := s.migrations().Apply(ctx, s.pool, s.verifyKey)
	if err != nil || !locked {
		// Current at the read-only check: the partitions are PartitionManager's.
		return nil, err
	}
	if s.cfg.Partitioning != nil {
		// The partitions claims need right away: the previous, current and next periods.
		// The lead and the retention window: PartitionManager or `partitions ensure`.
		now, step := time.Now(), s.cfg.Partitioning.Interval.Duration()
		if _, err := s.EnsurePartitions(ctx, now.Add(-step), now.Add(step)); err != nil {
			return applied, err
		}
	}
	return applied, nil
}

// quoteLiteral quotes s as a standard-conforming SQL string literal (migrate.QuoteLiteral).
// Inputs here are quoted identifiers built from validated names, never user data.
var quoteLiteral = migrate.QuoteLiteral

// MigrationSQL returns the migration script (see Store.MigrationSQL) for cfg without a
// database connection, or an error wrapping inbox.ErrInvalidConfig for invalid names.
func MigrationSQL(cfg Config) (string, error) {
	s, err := newNames(cfg)
	if err != nil {
		return "", err
	}
	return s.MigrationSQL()
}

// verifyKey checks that the inbox table has the configured layout: a unique index on exactly
// its key columns ((message_id, consumer_name) in the text layout, (message_id, consumer_id)
// in the compact one, plus period when partitioned), message_id of the layout's type,
// partitioned exactly when the store is, and the layout's time column (received_at
// timestamptz in the text layout, received_minute integer in the compact one since migration
// 0003). CREATE TABLE IF NOT EXISTS adopts an existing table of that name whatever its shape,
// and the claim's conflict target needs that index (without it every claim fails with SQLSTATE
// 42P10). A table of another layout gets an error wrapping inbox.ErrInvalidConfig that points
// to the conversion (LayoutMigrationSQL, `watermill-inbox layout convert`).
func (s *Store) verifyKey(ctx context.Context, tx pgx.Tx) error {
	want := []string{"consumer_name", "message_id"}
	typ := "text"
	if s.cfg.Layout == LayoutCompact {
		want, typ = []string{"consumer_id", "message_id"}, "uuid"
	}
	if s.cfg.Partitioning != nil {
		want = append(want, "period")
	}
	recvType := "timestamp with time zone"
	if s.cfg.Layout == LayoutCompact {
		recvType = "integer"
	}
	var ok, partitioned bool
	var idType, recv *string
	err := tx.QueryRow(ctx, `
		SELECT EXISTS (
			SELECT 1 FROM pg_index i
			WHERE i.indrelid = $1::regclass AND i.indisunique AND i.indnkeyatts = cardinality($2::name[])
			  AND (SELECT array_agg(a.attname ORDER BY a.attname)
			       FROM pg_attribute a
			       WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey::int2[]))
			      = $2::name[]),
		       (SELECT relkind = 'p' FROM pg_class WHERE oid = $1::regclass),
		       (SELECT format_type(atttypid, NULL) FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'message_id'),
		       (SELECT format_type(atttypid, NULL) FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $3 AND NOT attisdropped)`,
		s.table, want, s.receivedColumn()).Scan(&ok, &partitioned, &idType, &recv)
	if err != nil {
		return fmt.Errorf("pgstore: migrate: verify the inbox key: %w", err)
	}
	if !ok || idType == nil || *idType != typ || partitioned != (s.cfg.Partitioning != nil) || recv == nil || *recv != recvType {
		have := "a plain table"
		if partitioned {
			have = "a partitioned table"
		}
		return fmt.Errorf("%w: pgstore: table %s (%s, message_id %s) does not have the configured layout (%s, partitioned %v: a unique key on %v); it was created by other settings or other software. Convert it explicitly (`watermill-inbox layout convert`, pgstore.LayoutMigrationSQL; docs/retention.md), or configure the layout it has",
			inbox.ErrInvalidConfig, s.table, have, deref(idType), s.cfg.Layout, s.cfg.Partitioning != nil, want)
	}
	return nil
}
