// Package migrate is the migration runner shared by the PostgreSQL tables of this module
// (pgstore's inbox tables, deferred's store-then-process table): numbered SQL files embedded
// in the package that owns the table, rendered with text/template for a configured schema and
// table, recorded per table in the schema's version table (watermill_inbox_migrations), and
// applied in one transaction under a transaction-level advisory lock, with DDL only when
// something is pending. The packages keep their own exported types and errors; this package
// holds the logic they share.
package migrate

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"
)

// VersionsTable is the unquoted name of the version table, one per schema: rows are keyed by
// the quoted, schema-qualified table name, so the tables of several packages share it.
const VersionsTable = "watermill_inbox_migrations"

// LockKey is the advisory lock every Apply takes (pg_advisory_xact_lock of its
// hashtextextended), whatever the package: several instances starting at once apply each
// migration exactly once, the others wait and then find it recorded.
const LockKey = "watermill-inbox:migrate"

// Migration is one versioned schema change, rendered for a configured schema and table.
type Migration struct {
	// Version is the migration's number, from 1, from its file name ("0001_...sql").
	Version int
	// Name is the file name, e.g. "0001_create_processed_messages.sql".
	Name string
	// SQL is the statement text with the template's quoted identifiers substituted.
	SQL string
}

// Converted returns ms as a package's own exported Migration type (same fields).
func Converted[T ~struct {
	Version int
	Name    string
	SQL     string
}](ms []Migration) []T {
	out := make([]T, len(ms))
	for i, m := range ms {
		out[i] = T(m)
	}
	return out
}

// Set is the migrations of one table.
type Set struct {
	// Prefix starts every error message, e.g. "pgstore" or "deferred".
	Prefix string
	// Files holds the migrations as Dir/NNNN_name.sql.
	Files fs.FS
	// Dir is the folder in Files, e.g. "migrations".
	Dir string
	// Data is the template data the files are rendered with (quoted identifiers only;
	// templates run with missingkey=error).
	Data any
	// Schema is the unquoted schema; Apply creates it when it does not exist.
	Schema string
	// Table is the quoted, schema-qualified table the migrations are recorded for.
	Table string
	// Tables are the quoted tables Check requires to exist besides the version table
	// (Table first); Check reports them as missing in this order, the version table last.
	Tables []string
}

// Versions returns the quoted version table of the set's schema.
func (s Set) Versions() string { return pgx.Identifier{s.Schema, VersionsTable}.Sanitize() }

// Migrations reads, renders and sorts the migrations by version. It fails on a file name
// without a version prefix or on a template error.
func (s Set) Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(s.Files, s.Dir)
	if err != nil {
		return nil, err
	}
	var out []Migration
	for _, e := range entries {
		v, err := strconv.Atoi(strings.SplitN(e.Name(), "_", 2)[0])
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%s: migration file %q has no version prefix", s.Prefix, e.Name())
		}
		raw, err := fs.ReadFile(s.Files, path.Join(s.Dir, e.Name()))
		if err != nil {
			return nil, err
		}
		tmpl, err := template.New(e.Name()).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("%s: migration %s: %w", s.Prefix, e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, s.Data); err != nil {
			return nil, fmt.Errorf("%s: migration %s: %w", s.Prefix, e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: e.Name(), SQL: buf.String()})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Version < out[b].Version })
	return out, nil
}

// Script returns every migration as one SQL script for users who run their own migration
// tool, headed by "-- <title> for table <Table>": it creates the schema when missing and the
// version table, and records each version, so a later Apply finds them applied and does
// nothing.
func (s Set) Script(title string) (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- %s for table %s\nBEGIN;\n", title, s.Table)
	fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", pgx.Identifier{s.Schema}.Sanitize())
	b.WriteString(s.versionTableSQL() + ";\n")
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- %s\n%s\n", m.Name, strings.TrimSpace(m.SQL))
		fmt.Fprintf(&b, "INSERT INTO %s (table_name, version) VALUES (%s, %d) ON CONFLICT DO NOTHING;\n",
			s.Versions(), QuoteLiteral(s.Table), m.Version)
	}
	b.WriteString("COMMIT;\n")
	return b.String(), nil
}

func (s Set) versionTableSQL() string {
	return "CREATE TABLE IF NOT EXISTS " + s.Versions() + ` (
    table_name text        NOT NULL,
    version    integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
)`
}

// QuoteLiteral quotes s as a standard-conforming SQL string literal, for scripts. Inputs are
// quoted identifiers built from validated names and formatted times, never user data.
func QuoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// Querier is what Check reads through: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DB is what Apply runs on: a pool or a connection (Check reads through it, the changes run
// in transactions it begins).
type DB interface {
	Querier
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Status is what Check found: the quoted tables that do not exist (or that the role cannot
// see), in Set.Tables order with the version table last, and the migrations not recorded as
// applied, in version order.
type Status struct {
	Missing []string
	Pending []Migration
}

// Current reports whether nothing is missing or pending.
func (st Status) Current() bool { return len(st.Missing) == 0 && len(st.Pending) == 0 }

// PendingNames returns the file names of the pending migrations.
func (st Status) PendingNames() []string {
	var out []string
	for _, m := range st.Pending {
		out = append(out, m.Name)
	}
	return out
}

// Check reads, and never writes or locks, whether the set's tables and version table exist
// and which migrations are not recorded as applied. It needs USAGE on the schema and SELECT
// on the version table only. Its error is a rendering error or the database's, wrapped
// ("<Prefix>: check schema: ..."); a schema that is not current is a Status, not an error.
func (s Set) Check(ctx context.Context, q Querier) (Status, error) {
	ms, err := s.Migrations()
	if err != nil {
		return Status{}, err
	}
	tables := append(append([]string(nil), s.Tables...), s.Versions())
	var st Status
	exists := make([]bool, len(tables))
	var sel strings.Builder
	args := make([]any, len(tables))
	dest := make([]any, len(tables))
	sel.WriteString("SELECT ")
	for i, t := range tables {
		if i > 0 {
			sel.WriteString(", ")
		}
		fmt.Fprintf(&sel, "to_regclass($%d) IS NOT NULL", i+1)
		args[i], dest[i] = t, &exists[i]
	}
	if err := q.QueryRow(ctx, sel.String(), args...).Scan(dest...); err != nil {
		return Status{}, fmt.Errorf("%s: check schema: %w", s.Prefix, err)
	}
	for i, t := range tables {
		if !exists[i] {
			st.Missing = append(st.Missing, t)
		}
	}
	var done map[int]bool
	if exists[len(tables)-1] {
		if done, err = s.applied(ctx, q); err != nil {
			return Status{}, fmt.Errorf("%s: check schema: %w", s.Prefix, err)
		}
	}
	for _, m := range ms {
		if !done[m.Version] {
			st.Pending = append(st.Pending, m)
		}
	}
	return st, nil
}

// applied reads the versions recorded for the set's table.
func (s Set) applied(ctx context.Context, q Querier) (map[int]bool, error) {
	rows, err := q.Query(ctx, "SELECT version FROM "+s.Versions()+" WHERE table_name = $1", s.Table)
	if err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("read versions: %w", err)
	}
	done := make(map[int]bool, len(vs))
	for _, v := range vs {
		done[int(v)] = true
	}
	return done, nil
}

// Apply brings the schema up to date. It first checks, reading only (Check); when nothing is
// pending it runs verify (when not nil) in a transaction and returns, having written nothing,
// so a role without CREATE may call it at start-up. Otherwise, in one transaction under the
// advisory lock LockKey, it creates the schema when it does not exist (CREATE SCHEMA IF NOT
// EXISTS would need CREATE on the database even when it exists), creates the version table,
// applies and records each migration not yet recorded, and runs verify last. It returns the
// versions applied (none when current) and whether it took the lock (false: the read-only
// check found the schema current), or the first error ("<Prefix>: migrate: ..."), after which
// nothing is applied.
func (s Set) Apply(ctx context.Context, db DB, verify func(context.Context, pgx.Tx) error) (applied []int, locked bool, err error) {
	st, err := s.Check(ctx, db)
	if err != nil {
		return nil, false, err
	}
	if st.Current() {
		if verify == nil {
			return nil, false, nil
		}
		return nil, false, pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return verify(ctx, tx) })
	}
	if verify == nil {
		verify = func(context.Context, pgx.Tx) error { return nil }
	}
	ms, err := s.Migrations()
	if err != nil {
		return nil, false, err
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", LockKey); err != nil {
			return fmt.Errorf("%s: migrate: lock: %w", s.Prefix, err)
		}
		var schemaExists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s.Schema).Scan(&schemaExists); err != nil {
			return fmt.Errorf("%s: migrate: look up schema: %w", s.Prefix, err)
		}
		if !schemaExists {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s.Schema}.Sanitize()); err != nil {
				return fmt.Errorf("%s: migrate: create schema: %w", s.Prefix, err)
			}
		}
		if _, err := tx.Exec(ctx, s.versionTableSQL()); err != nil {
			return fmt.Errorf("%s: migrate: version table: %w", s.Prefix, err)
		}
		done, err := s.applied(ctx, tx)
		if err != nil {
			return fmt.Errorf("%s: migrate: %w", s.Prefix, err)
		}
		for _, m := range ms {
			if done[m.Version] {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("%s: migrate: %s: %w", s.Prefix, m.Name, err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+s.Versions()+" (table_name, version) VALUES ($1, $2)", s.Table, m.Version); err != nil {
				return fmt.Errorf("%s: migrate: record %s: %w", s.Prefix, m.Name, err)
			}
			applied = append(applied, m.Version)
		}
		return verify(ctx, tx)
	})
	if err != nil {
		return nil, true, err
	}
	return applied, true, nil
}

// Describe is the message of a package's schema error: "<prefix>: the schema of <table> is
// not current: missing tables ...; pending migrations ... (<hint>)".
func Describe(prefix, table string, missing, pending []string, hint string) string {
	var parts []string
	if len(missing) > 0 {
		parts = append(parts, "missing tables "+strings.Join(missing, ", "))
	}
	if len(pending) > 0 {
		parts = append(parts, "pending migrations "+strings.Join(pending, ", "))
	}
	return fmt.Sprintf("%s: the schema of %s is not current: %s (%s)", prefix, table, strings.Join(parts, "; "), hint)
}
