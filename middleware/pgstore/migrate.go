package pgstore

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrationsTable records applied migrations per inbox table, in the inbox table's schema.
const migrationsTable = "watermill_inbox_migrations"

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
	Compact           bool
	Partitioned       bool
}

// Migrations returns the store's migrations in version order, rendered for its schema and
// table. Use MigrationSQL to get them as one script.
func (s *Store) Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	names := migrationNames{
		Table:             s.table,
		TableLiteral:      quoteLiteral(s.table),
		ReceivedAtIndex:   pgx.Identifier{s.cfg.Table + "_received_at_idx"}.Sanitize(),
		Attempts:          s.attempts,
		AttemptsDeadIndex: pgx.Identifier{s.cfg.Table + "_dead_idx"}.Sanitize(),
		Consumers:         s.consumers,
		Compact:           s.cfg.Layout == LayoutCompact,
		Partitioned:       s.cfg.Partitioning != nil,
	}
	var out []Migration
	for _, e := range entries {
		v, err := strconv.Atoi(strings.SplitN(e.Name(), "_", 2)[0])
		if err != nil || v < 1 {
			return nil, fmt.Errorf("pgstore: migration file %q has no version prefix", e.Name())
		}
		raw, err := migrationFiles.ReadFile(path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		tmpl, err := template.New(e.Name()).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("pgstore: migration %s: %w", e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, names); err != nil {
			return nil, fmt.Errorf("pgstore: migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: e.Name(), SQL: buf.String()})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Version < out[b].Version })
	return out, nil
}

// MigrationSQL returns every migration as one SQL script, for users who run their own
// migration tool. The script creates the schema when missing, creates the version table and
// records each version, so a later Migrate call sees them applied and does nothing.
func (s *Store) MigrationSQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- watermill-inbox schema for table %s\nBEGIN;\n", s.table)
	fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", pgx.Identifier{s.cfg.Schema}.Sanitize())
	b.WriteString(s.versionTableSQL() + ";\n")
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- %s\n%s\n", m.Name, strings.TrimSpace(m.SQL))
		fmt.Fprintf(&b, "INSERT INTO %s (table_name, version) VALUES (%s, %d) ON CONFLICT DO NOTHING;\n",
			s.versions, quoteLiteral(s.table), m.Version)
	}
	b.WriteString("COMMIT;\n")
	return b.String(), nil
}

func (s *Store) versionTableSQL() string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    table_name text        NOT NULL,
    version    integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
)`, s.versions)
}

// migrateLockKey is the advisory lock every Migrate call takes, so several instances starting
// at once apply each migration exactly once: the others wait, then find it recorded.
const migrateLockKey = "watermill-inbox:migrate"

// Migrate first checks, reading only, whether anything is pending (CheckSchema); when nothing
// is, it verifies the inbox key and returns, having written nothing, so an application role
// without CREATE may call it at start-up. Otherwise it applies pending migrations in one transaction, under a transaction-level advisory
// lock (pg_advisory_xact_lock), so it is safe when several instances start at once. It
// creates the schema when it does not exist (needing CREATE on the database only then), and
// verifies that the inbox table has the configured layout (see verifyKey): an error
// wrapping inbox.ErrInvalidConfig reports a pre-existing table of the same name with another
// layout or other keys. In partitioned mode it then creates the partitions of the previous,
// current and next periods (PartitionManager keeps the rest: the lead and the window). It returns the versions it applied (none when the schema is current) or the first
// error, after which nothing is applied.
func (s *Store) Migrate(ctx context.Context) (applied []int, err error) {
	// Read-only first: when nothing is pending, Migrate needs no DDL right, no lock and no
	// write, so a least-privileged application role may call it at start-up.
	if _, err := s.pending(ctx, s.pool); err == nil {
		if err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return s.verifyKey(ctx, tx) }); err != nil {
			return nil, err
		}
		return nil, nil
	} else if !errors.Is(err, ErrSchemaNotCurrent) {
		return nil, err
	}
	ms, err := s.Migrations()
	if err != nil {
		return nil, err
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", migrateLockKey); err != nil {
			return fmt.Errorf("pgstore: migrate: lock: %w", err)
		}
		// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
		// exists, which an application role often lacks: create it only when missing.
		var schemaExists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s.cfg.Schema).Scan(&schemaExists); err != nil {
			return fmt.Errorf("pgstore: migrate: look up schema: %w", err)
		}
		if !schemaExists {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s.cfg.Schema}.Sanitize()); err != nil {
				return fmt.Errorf("pgstore: migrate: create schema: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, s.versionTableSQL()); err != nil {
			return fmt.Errorf("pgstore: migrate: version table: %w", err)
		}
		done := map[int]bool{}
		rows, err := tx.Query(ctx, "SELECT version FROM "+s.versions+" WHERE table_name = $1", s.table)
		if err != nil {
			return fmt.Errorf("pgstore: migrate: read versions: %w", err)
		}
		versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("pgstore: migrate: read versions: %w", err)
		}
		for _, v := range versions {
			done[int(v)] = true
		}
		for _, m := range ms {
			if done[m.Version] {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("pgstore: migrate: %s: %w", m.Name, err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+s.versions+" (table_name, version) VALUES ($1, $2)", s.table, m.Version); err != nil {
				return fmt.Errorf("pgstore: migrate: record %s: %w", m.Name, err)
			}
			applied = append(applied, m.Version)
		}
		return s.verifyKey(ctx, tx)
	})
	if err != nil {
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

// quoteLiteral quotes s as a standard-conforming SQL string literal. Inputs here are quoted
// identifiers built from validated names, never user data.
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

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
// and the claim's ON CONFLICT needs that index (without it every claim fails with SQLSTATE
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
