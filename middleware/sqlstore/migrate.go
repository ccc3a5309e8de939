package sqlstore

import (
	"bytes"
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

// The migrations, per dialect, in migrations/<dialect>/NNNN_name.sql: one statement per file
// (MySQL commits every DDL statement on its own, so a file is the unit that is applied and
// recorded), rendered with text/template for the store's quoted names.
//
//go:embed migrations/postgres/*.sql migrations/mysql/*.sql
var migrationFiles embed.FS

// versionsTable records the applied migrations per inbox table, in the inbox table's schema
// (database). It is not pgstore's table: the two stores' versions are numbered apart.
const versionsTable = "watermill_inbox_sqlstore_migrations"

// migrateLock is the lock Migrate holds while it applies: pg_advisory_xact_lock of its hash
// on PostgreSQL, GET_LOCK on MySQL (waited for up to a minute).
const migrateLock = "watermill-inbox:sqlstore-migrate"

// Migration is one versioned schema change, rendered for the store's names.
type Migration struct {
	// Version is the migration's number, from 1, from its file name.
	Version int
	// Name is the file name, e.g. "0001_create_inbox.sql".
	Name string
	// SQL is the one statement, with the quoted names substituted.
	SQL string
}

// Migrations returns the store's migrations for its dialect, in version order.
func (s *Store) Migrations() ([]Migration, error) {
	dir := "migrations/" + s.d.name
	entries, err := fs.ReadDir(migrationFiles, dir)
	if err != nil {
		return nil, err
	}
	data := map[string]string{
		"Table": s.table, "Attempts": s.attempts,
		"ReceivedAtIndex":   s.d.quote(s.cfg.Table + "_received_at_idx"),
		"AttemptsDeadIndex": s.d.quote(s.cfg.Table + "_dead_idx"),
	}
	var out []Migration
	for _, e := range entries {
		v, err := strconv.Atoi(strings.SplitN(e.Name(), "_", 2)[0])
		if err != nil || v < 1 {
			return nil, fmt.Errorf("sqlstore: migration file %q has no version prefix", e.Name())
		}
		raw, err := fs.ReadFile(migrationFiles, path.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		tmpl, err := template.New(e.Name()).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("sqlstore: migration %s: %w", e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("sqlstore: migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: e.Name(), SQL: strings.TrimSpace(buf.String())})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Version < out[b].Version })
	return out, nil
}

// ph is the dialect's n-th placeholder (from 1).
func (s *Store) ph(n int) string {
	if s.d.positional {
		return "$" + strconv.Itoa(n)
	}
	return "?"
}

func (s *Store) versionTableSQL() string {
	if s.d.sessionLock {
		return "CREATE TABLE IF NOT EXISTS " + s.versions + ` (
    table_name VARCHAR(255) NOT NULL,
    version    INT          NOT NULL,
    applied_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (table_name, version)
) ENGINE = InnoDB`
	}
	return "CREATE TABLE IF NOT EXISTS " + s.versions + ` (
    table_name text        NOT NULL,
    version    integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
)`
}

// MigrationSQL returns every migration as one script for users who run their own migration
// tool: it creates the version table and records each version, so a later Migrate finds them
// applied and does nothing. On PostgreSQL it also creates the schema when missing.
func (s *Store) MigrationSQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- watermill-inbox sqlstore (%s) schema for table %s\n", s.d.name, s.table)
	if !s.d.sessionLock {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", s.d.quote(s.cfg.Schema))
	}
	b.WriteString(s.versionTableSQL() + ";\n")
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- %s\n%s;\nINSERT INTO %s (table_name, version) VALUES ('%s', %d);\n",
			m.Name, m.SQL, s.versions, strings.ReplaceAll(s.table, "'", "''"), m.Version)
	}
	return b.String(), nil
}

// MigrationSQL returns the migration script (Store.MigrationSQL) for cfg without a
// database, or an error wrapping inbox.ErrInvalidConfig for an invalid configuration.
func MigrationSQL(cfg Config) (string, error) {
	s, err := newNames(cfg)
	if err != nil {
		return "", err
	}
	return s.MigrationSQL()
}

// applied reads the versions recorded for the store's table; an error when the version
// table cannot be read (it does not exist, or the role may not read it).
func (s *Store) applied(ctx context.Context, q execerQuery) (map[int]bool, error) {
	rows, err := q.QueryContext(ctx, "SELECT version FROM "+s.versions+" WHERE table_name = "+s.ph(1), s.table)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	done := map[int]bool{}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		done[v] = true
	}
	return done, rows.Err()
}

type execerQuery interface {
	execer
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Migrate applies the pending migrations and returns their versions (none when the schema is
// current). It first reads the version table: when nothing is pending it writes nothing, so
// a role without DDL privileges may call it at start-up. Otherwise, under migrateLock (safe
// when several instances start at once), on PostgreSQL in one transaction that also creates
// the schema when missing, on MySQL one file at a time (each DDL statement commits on its
// own; a failure leaves the earlier files applied and recorded, and the next Migrate goes
// on from there). MySQL never creates the database.
func (s *Store) Migrate(ctx context.Context) ([]int, error) {
	ms, err := s.Migrations()
	if err != nil {
		return nil, err
	}
	if done, err := s.applied(ctx, s.db); err == nil && len(pending(ms, done)) == 0 {
		return nil, nil
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("sqlstore: migrate: %w", err)
	}
	defer func() { _ = conn.Close() }()
	if s.d.sessionLock {
		return s.migrateMySQL(ctx, conn, ms)
	}
	var applied []int
	err = s.inTxOnce(ctx, conn, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", migrateLock); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		var exists bool
		if err := tx.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s.cfg.Schema).Scan(&exists); err != nil {
			return fmt.Errorf("look up schema: %w", err)
		}
		if !exists {
			if _, err := tx.ExecContext(ctx, "CREATE SCHEMA "+s.d.quote(s.cfg.Schema)); err != nil {
				return fmt.Errorf("create schema: %w", err)
			}
		}
		var err error
		applied, err = s.applyPending(ctx, tx, ms)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sqlstore: migrate: %w", err)
	}
	return applied, nil
}

func (s *Store) migrateMySQL(ctx context.Context, conn *sql.Conn, ms []Migration) ([]int, error) {
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 60)", migrateLock).Scan(&got); err != nil || got.Int64 != 1 {
		return nil, fmt.Errorf("sqlstore: migrate: lock (%v): %w", got, err)
	}
	defer func() { _, _ = conn.ExecContext(context.WithoutCancel(ctx), "DO RELEASE_LOCK(?)", migrateLock) }()
	applied, err := s.applyPending(ctx, conn, ms)
	if err != nil {
		return applied, fmt.Errorf("sqlstore: migrate: %w", err)
	}
	return applied, nil
}

// applyPending creates the version table, then applies and records each migration not yet
// recorded.
func (s *Store) applyPending(ctx context.Context, q execerQuery, ms []Migration) ([]int, error) {
	if _, err := q.ExecContext(ctx, s.versionTableSQL()); err != nil {
		return nil, fmt.Errorf("version table: %w", err)
	}
	done, err := s.applied(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	var applied []int
	for _, m := range pending(ms, done) {
		if _, err := q.ExecContext(ctx, m.SQL); err != nil {
			return applied, fmt.Errorf("%s: %w", m.Name, err)
		}
		if _, err := q.ExecContext(ctx, "INSERT INTO "+s.versions+" (table_name, version) VALUES ("+s.ph(1)+", "+s.ph(2)+")", s.table, m.Version); err != nil {
			return applied, fmt.Errorf("record %s: %w", m.Name, err)
		}
		applied = append(applied, m.Version)
	}
	return applied, nil
}

func pending(ms []Migration, done map[int]bool) []Migration {
	var out []Migration
	for _, m := range ms {
		if !done[m.Version] {
			out = append(out, m)
		}
	}
	return out
}

// inTxOnce runs f in a transaction on b and commits; no retry.
func (s *Store) inTxOnce(ctx context.Context, b beginner, f func(*sql.Tx) error) error {
	tx, err := b.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
