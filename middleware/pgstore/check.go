package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrSchemaNotCurrent is wrapped by every *SchemaError: errors.Is(err, ErrSchemaNotCurrent)
// tells a schema that needs migrating from a database that cannot be reached.
var ErrSchemaNotCurrent = errors.New("pgstore: the inbox schema is not current")

// SchemaError is CheckSchema's answer when the schema needs migrating: the tables that do not
// exist and the migrations not recorded as applied. Run Migrate (or the script of
// MigrationSQL) as a role that may create tables, then check again.
type SchemaError struct {
	// Table is the quoted inbox table checked, e.g. "public"."inbox_processed_messages".
	Table string
	// Missing lists the quoted tables that do not exist (or that the role cannot see).
	Missing []string
	// Pending lists the migrations not recorded as applied, by file name, e.g.
	// "0002_create_attempts.sql".
	Pending []string
}

func (e *SchemaError) Error() string {
	var parts []string
	if len(e.Missing) > 0 {
		parts = append(parts, "missing tables "+strings.Join(e.Missing, ", "))
	}
	if len(e.Pending) > 0 {
		parts = append(parts, "pending migrations "+strings.Join(e.Pending, ", "))
	}
	return fmt.Sprintf("pgstore: the schema of %s is not current: %s (run Migrate or `watermill-inbox migrate` as the schema's owner)",
		e.Table, strings.Join(parts, "; "))
}

// Unwrap returns ErrSchemaNotCurrent.
func (e *SchemaError) Unwrap() error { return ErrSchemaNotCurrent }

// CheckSchema reports whether the inbox schema is current, reading only (no DDL, no lock):
// nil when the inbox table, the attempts table and the version table exist and every
// migration is recorded as applied; a *SchemaError (wrapping ErrSchemaNotCurrent) naming
// what is missing or pending; or the database's error, wrapped. It needs only what the
// application role has (USAGE on the schema, SELECT on the version table; see Grants), so it
// serves as a readiness probe and as the start-up check of a role that cannot create tables.
func (s *Store) CheckSchema(ctx context.Context) error {
	_, err := s.pending(ctx, s.pool)
	return err
}

// Querier is what the store's catalog reads run on: *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn
// or a pgx.Tx (pending runs on the pool or Migrate's transaction).
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// pending returns the migrations not recorded as applied, and a *SchemaError when the
// schema is not current (nil error when it is).
func (s *Store) pending(ctx context.Context, q Querier) ([]Migration, error) {
	ms, err := s.Migrations()
	if err != nil {
		return nil, err
	}
	var table, attempts, versions bool
	if err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL",
		s.table, s.attempts, s.versions).Scan(&table, &attempts, &versions); err != nil {
		return nil, fmt.Errorf("pgstore: check schema: %w", err)
	}
	serr := &SchemaError{Table: s.table}
	for _, t := range []struct {
		ok   bool
		name string
	}{{table, s.table}, {attempts, s.attempts}, {versions, s.versions}} {
		if !t.ok {
			serr.Missing = append(serr.Missing, t.name)
		}
	}
	done := map[int]bool{}
	if versions {
		rows, err := q.Query(ctx, "SELECT version FROM "+s.versions+" WHERE table_name = $1", s.table)
		if err != nil {
			return nil, fmt.Errorf("pgstore: check schema: read versions: %w", err)
		}
		vs, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return nil, fmt.Errorf("pgstore: check schema: read versions: %w", err)
		}
		for _, v := range vs {
			done[int(v)] = true
		}
	}
	var out []Migration
	for _, m := range ms {
		if !done[m.Version] {
			out = append(out, m)
			serr.Pending = append(serr.Pending, m.Name)
		}
	}
	if len(serr.Missing) > 0 || len(serr.Pending) > 0 {
		return out, serr
	}
	return nil, nil
}
